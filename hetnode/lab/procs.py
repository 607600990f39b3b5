"""A daemon (or any command) started inside a lab host: stdout read line by line for its READY line,
stderr to a log file, stopped with SIGTERM (killed only if it hangs)."""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from hetnode.errors import HetnodeError

log = logging.getLogger(__name__)

HETNODE = [sys.executable, "-m", "hetnode.cli.main"]
REPO_ROOT = Path(__file__).resolve().parents[2]
PR_SET_PDEATHSIG = 1


def _die_with_parent() -> Callable[[], None]:
    """A preexec_fn: SIGTERM to the child when the spawning thread dies (even by SIGKILL)."""
    libc = ctypes.CDLL(None, use_errno=True)  # loaded here: the forked child should only call into it
    parent = os.getpid()

    def preexec() -> None:
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
        if os.getppid() != parent:  # the parent died before prctl took effect
            os._exit(1)

    return preexec


class Interrupted(HetnodeError):
    """A stop signal arrived while waiting for a READY line."""


class LabProcess:
    """`detach=True`: its own process group, so a terminal's Ctrl+C reaches only the parent, which stops
    the children in order; and SIGTERM when the parent dies, so none outlives a killed parent."""

    def __init__(
        self,
        name: str,
        argv: list[str],
        log_path: Path,
        prefix: list[str] | None = None,
        *,
        detach: bool = False,
    ) -> None:
        self.name = name
        self.log_path = log_path
        self.detached = detach
        self._log = open(log_path, "w")  # noqa: SIM115 - closed in stop()
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        detached: dict[str, Any] = {"process_group": 0, "preexec_fn": _die_with_parent()} if detach else {}
        self.proc = subprocess.Popen(
            (prefix or []) + argv,
            stdout=subprocess.PIPE,
            stderr=self._log,
            text=True,
            cwd=REPO_ROOT,
            env=env,
            **detached,
        )
        self.lines: list[str] = []
        self.ready: dict[str, str] | None = None
        self._ready = threading.Event()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append(line.rstrip("\n"))
            if line.startswith("READY ") and self.ready is None:
                words = line.split()[1:]
                # daemons print key=value pairs; the all-reduce baseline prints its multiaddrs bare
                self.ready = dict(word.split("=", 1) for word in words if "=" in word)
                self.ready.setdefault("maddrs", ",".join(w for w in words if w.startswith("/")))
                self._ready.set()

    def wait_ready(self, timeout: float = 120.0, stop: threading.Event | None = None) -> dict[str, str]:
        """The READY line's fields; `stop` (set by a signal handler) ends the wait early with Interrupted."""
        deadline = time.monotonic() + timeout
        poll = 0.5 if stop is None else 0.2
        while not self._ready.wait(min(poll, max(0.0, deadline - time.monotonic()))):
            if stop is not None and stop.is_set():
                raise Interrupted(f"interrupted while waiting for {self.name}")
            if self.proc.poll() is not None:  # it will not come: say so now, not at the deadline
                raise HetnodeError(
                    f"{self.name} exited with {self.proc.returncode} before READY:\n{self.tail()}"
                )
            if time.monotonic() >= deadline:
                raise HetnodeError(f"{self.name} printed no READY line in {timeout:.0f} s:\n{self.tail()}")
        assert self.ready is not None
        return self.ready

    @property
    def maddr(self) -> str:
        assert self.ready is not None
        return self.ready["maddrs"].split(",")[0]

    def tail(self, lines: int = 20) -> str:
        if not self._log.closed:
            self._log.flush()
        return "\n".join(self.log_path.read_text().splitlines()[-lines:])

    def stop(self, timeout: float = 30.0) -> int | None:
        """SIGTERM, then SIGKILL if it has not exited within `timeout`; then whatever is left of its
        process group (a detached daemon's p2pd) is killed too."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        return self.finish(timeout)

    def finish(self, timeout: float) -> int | None:
        """Wait up to `timeout` for an exit already asked for, kill what is left, close the log."""
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            log.warning("%s did not stop within %.0f s: killing it", self.name, timeout)
            self.proc.kill()
            self.proc.wait(10)
        if self.detached:  # our own group: p2pd and DHT helpers of a killed daemon are in it, orphaned
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.proc.pid, signal.SIGKILL)
        self._log.close()
        return self.proc.returncode


def stop_all(processes: list[LabProcess], grace_s: float = 5.0) -> None:
    """SIGTERM to every process at once, a shared `grace_s` to exit, then SIGKILL for what is left:
    stopping ten daemons takes one grace period, not ten."""
    for process in processes:
        if process.proc.poll() is None:
            process.proc.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    for process in processes:
        process.finish(max(0.0, deadline - time.monotonic()))
