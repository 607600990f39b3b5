"""The user-space WAN emulator of the network lab (no netem here): one process, started by NetLab, that
owns a pair of TAP devices per emulated host and moves every frame between them through a `DelayLine`.

    host namespace: tap e<i> (the host's address)  <->  emulator  <->  hub namespace: tap h<i> on the bridge

Frames the host sends are read from its tap (after tc's tbf on that tap has paced them to the upload
rate), held for the one-way delay and written into the hub's tap, which the bridge forwards; frames
toward the host take the other way (tbf on the hub's tap paces the download). ARP crosses the emulator
too, as it would cross a real link. The taps belong to this process: they vanish when it exits, and if
its parent dies (PR_SET_PDEATHSIG, or its stdin reaching EOF) it deletes the lab's namespaces too, so a
killed benchmark leaves nothing behind.

Run as `python -m hetnode.lab.netlab.wan_emulator SPEC_JSON` (root); it prints READY once the taps exist.
"""

from __future__ import annotations

import ctypes
import fcntl
import json
import os
import random
import select
import signal
import struct
import subprocess
import sys
import time
from dataclasses import asdict, dataclass

from hetnode.errors import HetnodeError
from hetnode.lab.netlab.wan import DelayLine, LinkProfile
from hetnode.lab.procs import _die_with_parent

TUNSETIFF = 0x400454CA
IFF_TAP = 0x0002
IFF_NO_PI = 0x1000
CLONE_NEWNET = 0x40000000
READ_BATCH = 256  # frames read from one tap before the loop looks at the others


@dataclass(frozen=True)
class EmulatedLink:
    host_namespace: str
    host_device: str
    hub_namespace: str
    hub_device: str
    profile: LinkProfile


def _setns(fd: int) -> None:
    """Move this (single-threaded) process into the network namespace open at `fd`."""
    if ctypes.CDLL(None, use_errno=True).setns(fd, CLONE_NEWNET) != 0:
        raise OSError(ctypes.get_errno(), "setns")


def _enter(namespace: str) -> None:
    fd = os.open(f"/var/run/netns/{namespace}", os.O_RDONLY)
    try:
        _setns(fd)
    finally:
        os.close(fd)


def _open_tap(name: str) -> int:
    fd = os.open("/dev/net/tun", os.O_RDWR | os.O_NONBLOCK)
    fcntl.ioctl(fd, TUNSETIFF, struct.pack("16sH22x", name.encode(), IFF_TAP | IFF_NO_PI))
    return fd


def _lines(profile: LinkProfile, rng: random.Random) -> tuple[DelayLine, DelayLine]:
    """(upload, download) lines of one link, each with its own RNG drawn from the run's seed."""
    return tuple(  # type: ignore[return-value]
        DelayLine(
            profile.delay_ms / 1000,
            profile.jitter_ms / 1000,
            profile.loss,
            reorder=profile.reorder,
            rng=random.Random(rng.getrandbits(64)),
        )
        for _ in range(2)
    )


def _delete_lab_namespaces(tag: str) -> None:
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, timeout=30).stdout
    for line in listed.splitlines():
        name = line.split()[0] if line.split() else ""
        if name.startswith("hnl-") and name.endswith(f"-{tag}"):
            subprocess.run(["ip", "netns", "del", name], capture_output=True, timeout=30)


class _Exit(Exception):
    pass


def _on_signal(signum: int, frame: object) -> None:
    raise _Exit(signum)


def serve(links: list[EmulatedLink], seed: int) -> None:
    """Create the taps, print READY, move frames until SIGTERM or EOF on stdin."""
    rng = random.Random(seed)
    home_fd = os.open("/proc/self/ns/net", os.O_RDONLY)  # to come back to: `ip netns del` runs from it
    routes: dict[int, tuple[DelayLine, int]] = {}  # fd read -> (its line, the fd its frames go to)
    try:
        for link in links:
            _enter(link.host_namespace)
            host_fd = _open_tap(link.host_device)
            _enter(link.hub_namespace)
            hub_fd = _open_tap(link.hub_device)
            up, down = _lines(link.profile, rng)
            routes[host_fd] = (up, hub_fd)
            routes[hub_fd] = (down, host_fd)
    finally:
        _setns(home_fd)
        os.close(home_fd)
    try:  # noqa: SIM105 - a frame's delay should not include waiting for a CPU that others hold
        os.sched_setscheduler(0, os.SCHED_RR, os.sched_param(1))
    except OSError:
        pass
    print("READY", flush=True)
    _forward(routes, sys.stdin.fileno())


def _forward(routes: dict[int, tuple[DelayLine, int]], parent_fd: int) -> None:
    """The loop: read what is ready into its line, write what is due. select() rather than epoll: its
    timeout has microseconds where epoll's has milliseconds (up to 1 ms late per hop)."""
    watched = [*routes, parent_fd]
    pairs = list(routes.values())
    timeout: float | None = None
    while True:
        readable, _, _ = select.select(watched, [], [], timeout)
        for fd in readable:
            if fd == parent_fd:
                if not os.read(fd, 4096):
                    raise _Exit("stdin closed")
                continue
            line = routes[fd][0]
            now = time.monotonic()
            for _ in range(READ_BATCH):
                try:
                    line.push(now, os.read(fd, 65536))
                except BlockingIOError:
                    break
        now = time.monotonic()
        timeout = None
        for line, out_fd in pairs:
            for frame in line.pop_due(now):
                try:  # noqa: SIM105 - per frame: a plain try is cheaper than contextlib.suppress
                    os.write(out_fd, frame)
                except OSError:  # the tap is gone or full: the frame is lost, as on a real link
                    pass
            due = line.next_due()
            if due is not None:
                wait = max(0.0, due - now)
                timeout = wait if timeout is None else min(timeout, wait)


def main(argv: list[str]) -> int:
    spec = json.loads(argv[0])
    parent = os.getppid()
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, _on_signal)
    links = [EmulatedLink(**{**link, "profile": LinkProfile(**link["profile"])}) for link in spec["links"]]
    try:
        serve(links, spec["seed"])
    except _Exit:
        pass
    finally:
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            signal.signal(sig, signal.SIG_IGN)  # cleaning up: a second signal must not cut it short
        if os.getppid() != parent:
            _delete_lab_namespaces(spec["tag"])  # the lab's owner is gone: nobody else will
    return 0


class Emulator:
    """The emulator process of one lab: `Emulator(links, tag, seed)` returns once its taps exist."""

    def __init__(self, links: list[EmulatedLink], tag: str, seed: int, timeout: float = 30.0) -> None:
        spec = {
            "tag": tag,
            "seed": seed,
            "links": [asdict(link) for link in links],
        }
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "hetnode.lab.netlab.wan_emulator", json.dumps(spec)],
            stdin=subprocess.PIPE,  # never written: its EOF tells the emulator that this process died
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            process_group=0,  # a terminal's Ctrl+C reaches the lab's owner, which stops us in order
            preexec_fn=_die_with_parent(),
        )
        assert self.proc.stdout is not None
        ready, _, _ = select.select([self.proc.stdout], [], [], timeout)
        line = self.proc.stdout.readline() if ready else ""
        if line.strip() != "READY":
            self.stop()
            err = self.proc.stderr.read() if self.proc.stderr else ""
            raise HetnodeError(f"the WAN emulator did not start: {err.strip()[-2000:] or 'no READY'}")

    def alive(self) -> bool:
        return self.proc.poll() is None

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        for stream in (self.proc.stdin, self.proc.stdout, self.proc.stderr):
            if stream is not None:
                stream.close()


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
