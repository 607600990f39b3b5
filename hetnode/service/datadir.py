"""A daemon's data directory: one daemon at a time (a lock), small JSON state written atomically, and files
moved aside (never deleted) when a daemon starts over in the same folder."""

from __future__ import annotations

import fcntl
import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any, TextIO

from hetnode.errors import HetnodeError
from hetnode.files import atomic_write_text


class DataDir:
    def __init__(self, path: Path) -> None:
        self.path = Path(path).expanduser()
        self._lock: TextIO | None = None

    def __enter__(self) -> DataDir:
        self.path.mkdir(parents=True, exist_ok=True)
        lock = open(self.path / "daemon.lock", "a+")  # noqa: SIM115 - held for the daemon's lifetime
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            lock.seek(0)
            holder = lock.read().strip() or "another process"
            lock.close()
            raise HetnodeError(
                f"data dir {self.path} is in use by pid {holder}; give each daemon its own --data-dir"
            ) from None
        lock.seek(0)
        lock.truncate()
        lock.write(str(os.getpid()))
        lock.flush()
        self._lock = lock
        return self

    def __exit__(self, *exc: object) -> None:
        if self._lock is not None:
            self._lock.close()
            self._lock = None

    def read_json(self, name: str) -> dict[str, Any]:
        path = self.path / name
        if not path.exists():
            return {}
        try:
            data = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError) as exc:
            raise HetnodeError(f"{path} is unreadable ({exc}); fix or remove it") from None
        if not isinstance(data, dict):
            raise HetnodeError(f"{path} does not hold a JSON object")
        return data

    def write_json(self, name: str, data: dict[str, Any]) -> None:
        """Atomic: a reader, or a start after a crash, finds the old file or the new one, whole (a rename over
        it). No fsync: daemons write here from their event loop, which must not wait behind the disk
        flushing a checkpoint."""
        atomic_write_text(self.path / name, json.dumps(data, indent=1, sort_keys=True), durable=False)

    def move_aside(self, names: Sequence[str], folder: str) -> list[str]:
        """Move those of `names` that exist into `DATA_DIR/folder` (created), in the order given; the ones
        moved. Renames inside the data dir: nothing is copied or deleted, each move is all or nothing."""
        present = [name for name in names if (self.path / name).exists()]
        if not present:
            return []
        target = self.path / folder
        target.mkdir(parents=True, exist_ok=False)
        for name in present:
            os.replace(self.path / name, target / name)
        for folder_path in (target, self.path):  # once, at start-up: make the renames survive a power cut
            _sync_folder(folder_path)
        return present


def _sync_folder(path: Path) -> None:
    """POSIX records a rename in the folder: syncing it makes the rename durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
