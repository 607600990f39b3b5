"""Files that a crash never leaves half written: each is filled beside its path and renamed over it, so a
reader (or a start after a crash) finds the old file or the new one, whole. Shared by every layer (stdlib
only), like `config` and `errors`."""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable
from pathlib import Path


def atomic_write(path: Path, fill: Callable[[Path], None], durable: bool = True) -> None:
    """`fill(tmp)` writes the content to a new file beside `path`, which then replaces `path`. `durable`:
    flushed to the disk first (a power cut keeps it too); False where the caller must not wait behind the
    disk (a daemon's event loop). A failure leaves `path` as it was and no temporary file behind."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, name = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    os.close(fd)
    tmp = Path(name)
    try:
        fill(tmp)
        if durable:
            with open(tmp, "rb") as written:
                os.fsync(written.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def atomic_write_text(path: Path, text: str, durable: bool = True) -> None:
    """`atomic_write` of UTF-8 text."""
    atomic_write(path, lambda tmp: tmp.write_text(text, encoding="utf-8"), durable)


def atomic_write_bytes(path: Path, data: bytes, durable: bool = True) -> None:
    """`atomic_write` of bytes."""
    atomic_write(path, lambda tmp: tmp.write_bytes(data), durable)
