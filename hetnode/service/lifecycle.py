"""Process lifecycle shared by the coordinator and peers: stop on SIGINT/SIGTERM, the READY line, waits."""

from __future__ import annotations

import asyncio
import logging
import signal
import sys
from collections.abc import Awaitable, Sequence
from typing import TypeVar

from hetnode.errors import Stopped  # there, for the CLI to catch without asyncio; imported from here too

log = logging.getLogger(__name__)

T = TypeVar("T")


class SignalStop(asyncio.Event):
    """Set by the first SIGINT or SIGTERM (`signalled`); `again` by a second one: what shutdown still
    waits for (a leaving stage's handoff) ends at once."""

    def __init__(self) -> None:
        super().__init__()
        self.signalled = False
        self.again = asyncio.Event()


def stop_on_signals() -> SignalStop:
    """An event set by SIGINT or SIGTERM; the daemon then shuts down in order and exits 0."""
    stop = SignalStop()
    loop = asyncio.get_running_loop()

    def request_stop(signum: int) -> None:
        if stop.signalled:
            log.info("%s received again: quitting now", signal.Signals(signum).name)
            stop.again.set()
        elif not stop.is_set():
            log.info("%s received: shutting down", signal.Signals(signum).name)
        stop.signalled = True
        stop.set()

    for signum in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(signum, request_stop, signum)
    return stop


def release_signals() -> None:
    """SIGINT and SIGTERM back to Python's defaults: a one-shot command (status) may run in a process that
    lives on, such as a test run, and the loop's handlers would outlive the loop."""
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGINT, signal.SIGTERM):
        loop.remove_signal_handler(signum)


async def until_stopped(stop: asyncio.Event, tasks: Sequence[asyncio.Task]) -> None:
    """Wait for `stop`, or for a task to end first; a task's failure is raised here (the daemon exits)."""
    waiter = asyncio.ensure_future(stop.wait())
    try:
        done, _ = await asyncio.wait([waiter, *tasks], return_when=asyncio.FIRST_COMPLETED)
    finally:
        waiter.cancel()
    for task in done:
        if task is not waiter and not task.cancelled() and task.exception() is not None:
            raise task.exception()


async def sleep_or_stop(stop: asyncio.Event, seconds: float) -> bool:
    """Sleep up to `seconds`; True when woken by `stop`."""
    try:
        await asyncio.wait_for(stop.wait(), max(0.0, seconds))
    except TimeoutError:
        return False
    return True


async def unless_stopped(stop: asyncio.Event, work: Awaitable[T], what: str) -> T:
    """`work`'s result, or `Stopped` as soon as `stop` is set: a wait on the network (a request with a
    long timeout, a p2pd start) must not hold up a Ctrl+C. The cancelled work runs its cleanup first."""
    task = asyncio.ensure_future(work)
    waiter = asyncio.ensure_future(stop.wait())
    try:
        await asyncio.wait([task, waiter], return_when=asyncio.FIRST_COMPLETED)
    finally:
        waiter.cancel()
        interrupted = not task.done()
        if interrupted:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)  # its `finally` blocks, e.g. a node shutdown
    if interrupted:
        raise Stopped(f"stopped while {what}")
    return task.result()


def print_ready(peer_id: str, maddrs: Sequence[str], **extra: object) -> None:
    """The one machine-readable line scripts and tests wait for."""
    fields = " ".join(f"{key}={value}" for key, value in extra.items())
    print(f"READY peer_id={peer_id} maddrs={','.join(maddrs)}" + (f" {fields}" if fields else ""), flush=True)
    sys.stdout.flush()


async def sleep_or_wake(stop: asyncio.Event, wake: asyncio.Event, seconds: float) -> bool:
    """Sleep up to `seconds` or until `wake` is set (then cleared); True when woken by `stop`."""
    waiters = [asyncio.ensure_future(stop.wait()), asyncio.ensure_future(wake.wait())]
    try:
        await asyncio.wait(waiters, timeout=max(0.0, seconds), return_when=asyncio.FIRST_COMPLETED)
    finally:
        for waiter in waiters:
            waiter.cancel()
    wake.clear()
    return stop.is_set()
