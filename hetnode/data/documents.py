"""What every text source yields (a keyed document), which split a document falls in, and how a source
names its files in a cache key."""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Document:
    key: str  # stable identity: decides the train/eval split and the sort order
    text: str


def is_eval_key(key: str, eval_fraction: float) -> bool:
    """A document is held out iff a keyed hash of its key lands below `eval_fraction`: stable everywhere."""
    digest = hashlib.blake2b(key.encode("utf-8"), digest_size=8, person=b"hetnode-eval").digest()
    return int.from_bytes(digest, "little") / 2**64 < eval_fraction


def split_documents(docs: Sequence[Document], eval_fraction: float) -> tuple[list[Document], list[Document]]:
    """(train, eval) by `is_eval_key`; adding documents never moves an existing one across the split."""
    train: list[Document] = []
    held: list[Document] = []
    for doc in docs:
        (held if is_eval_key(doc.key, eval_fraction) else train).append(doc)
    return train, held


def file_stats(root: Path, files: Iterable[Path]) -> list[list[str | int]]:
    """[relative path, size, mtime_ns] per file: enough to notice an edited corpus without reading it."""
    stats: list[list[str | int]] = []
    for path in files:
        st = path.stat()
        rel = path.name if path == root else path.relative_to(root).as_posix()
        stats.append([rel, st.st_size, st.st_mtime_ns])
    return stats


class SkippedRows:
    """Counts rows that hold no text (null, or only whitespace) and says so once, when reading ends."""

    def __init__(self, where: str, column: str) -> None:
        self.where = where
        self.column = column
        self.nulls = 0
        self.blank = 0

    def report(self) -> None:
        if self.nulls:
            log.warning(
                "%s: skipped %d null row(s) in column %r (and %d blank)",
                self.where,
                self.nulls,
                self.column,
                self.blank,
            )
        elif self.blank:
            log.info("%s: skipped %d blank row(s) in column %r", self.where, self.blank, self.column)
