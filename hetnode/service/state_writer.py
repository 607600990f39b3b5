"""Local state written off the training thread and the event loop: one writer thread, newest state first."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

log = logging.getLogger(__name__)


class LatestStateWriter:
    """Writes each submitted state with `write` in a thread of its own. A state submitted while another is
    being written replaces any still waiting: only the newest matters for a restart, and a slow disk never
    holds up the caller."""

    def __init__(self, write: Callable[[dict], None]) -> None:
        self._write = write
        self._pending: dict | None = None
        self._busy = False
        self._closed = False
        self._cond = threading.Condition()
        self._thread = threading.Thread(target=self._run, name="state-writer", daemon=True)
        self._thread.start()
        self.written = 0  # states written so far (tests, logs)

    def submit(self, state: dict) -> None:
        with self._cond:
            self._pending = state
            self._cond.notify_all()

    def flush(self, timeout: float) -> bool:
        """Wait until everything submitted is written; False if that took longer than `timeout`."""
        with self._cond:
            return self._cond.wait_for(lambda: self._pending is None and not self._busy, timeout)

    def close(self, timeout: float = 30.0) -> None:
        """Write what is waiting, then stop the thread."""
        self.flush(timeout)
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        self._thread.join(timeout)

    def _run(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._pending is not None or self._closed)
                if self._pending is None:
                    return
                state, self._pending, self._busy = self._pending, None, True
            try:
                self._write(state)
                self.written += 1
            except Exception:  # a full disk must not end the daemon: the next state is tried again
                log.exception("writing the local state failed")
            finally:
                with self._cond:
                    self._busy = False
                    self._cond.notify_all()
