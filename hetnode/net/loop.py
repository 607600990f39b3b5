"""The daemon's event loop: uvloop, and every child process it spawns dies with the daemon.

hivemind starts `p2pd` as a child of whichever process creates the P2P object. If the daemon is killed
with SIGKILL it cannot clean up, and `p2pd` would live on forever. So every subprocess this loop spawns
asks the kernel (PR_SET_PDEATHSIG) for SIGTERM when the thread that spawned it dies. The loop must run
in a thread that lives as long as the daemon (the main thread): the signal follows the spawning thread.
"""

from __future__ import annotations

import asyncio
import ctypes
import os
import signal
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

import uvloop

PR_SET_PDEATHSIG = 1
T = TypeVar("T")


def _die_with_parent(parent_pid: int) -> Callable[[], None]:
    def preexec() -> None:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
        if os.getppid() != parent_pid:  # the parent died before prctl took effect
            os._exit(1)

    return preexec


class DaemonLoop(uvloop.Loop):  # type: ignore[misc]
    async def subprocess_exec(self, *args: Any, **kwargs: Any) -> Any:
        kwargs.setdefault("preexec_fn", _die_with_parent(os.getpid()))
        return await super().subprocess_exec(*args, **kwargs)


def run(main: Coroutine[Any, Any, T]) -> T:
    """Run `main` to completion on a fresh DaemonLoop in this thread."""
    loop = DaemonLoop()
    asyncio.set_event_loop(loop)
    try:
        return loop.run_until_complete(main)
    finally:
        try:
            _cancel_remaining(loop)
            loop.run_until_complete(loop.shutdown_asyncgens())
        finally:
            asyncio.set_event_loop(None)
            loop.close()


def _cancel_remaining(loop: asyncio.AbstractEventLoop) -> None:
    tasks = [t for t in asyncio.all_tasks(loop) if not t.done()]
    for task in tasks:
        task.cancel()
    if tasks:
        loop.run_until_complete(asyncio.gather(*tasks, return_exceptions=True))
