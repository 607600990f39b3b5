"""Token streams of a text source: tokenised once into memory-mapped shards, reused on every later build.

The cache key (see `shards.py`) hashes the source's identity (its files' sizes and mtimes, the column, the
document cap), the tokenizer (and its pinned hash, when the run pins one) and the eval fraction: everything
that changes the streams. A run that pins its BPE tokenises with the pinned copy in the data cache when there
is one (`pinned_tokenizer.py`), and learns none of its own. Documents are streamed in chunks and written as
they are tokenised, so only a chunk is in memory, never the corpus.
"""

from __future__ import annotations

import hashlib
import logging
import shutil
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
from tqdm import tqdm

from hetnode.config import DataConfig
from hetnode.data.documents import Document, is_eval_key, split_documents
from hetnode.data.pinned_tokenizer import check_trained, is_pinned, load_pinned
from hetnode.data.shards import (
    DTYPE,
    FORMAT,
    SPLITS,
    ShardsUnusable,
    ShardWriter,
    fingerprint,
    install,
    load_shards,
    new_build,
)
from hetnode.data.sources import iter_documents, source_identity
from hetnode.data.tokenizer import BpeTokenizer, ByteTokenizer, Tokenizer, make_tokenizer
from hetnode.errors import DataError

log = logging.getLogger(__name__)

ENCODE_DOCS = 512  # documents per tokeniser call: bounds memory while a BPE's threads stay busy


def document_streams(
    cfg: DataConfig, vocab_size: int, data_dir: Path
) -> tuple[Tokenizer, list[np.ndarray], list[np.ndarray]]:
    """The memory-mapped token shards of a text source: reused when a valid build exists, else built."""
    key = {
        "data": source_identity(cfg),
        "tokenizer": cfg.tokenizer,
        "bpe_vocab_size": cfg.bpe_vocab_size if cfg.tokenizer == "bpe" else None,
        "eval_fraction": cfg.eval_fraction,
    }
    if is_pinned(cfg):  # absent otherwise: the streams cached before pins existed keep their folder
        key["tokenizer_sha256"] = cfg.tokenizer_sha256
    folder = data_dir / "tokens" / fingerprint(key)
    try:
        shards = load_shards(folder, key)
        tokenizer = _manifest_tokenizer(shards.manifest, cfg, data_dir)
        log.debug("reusing token shards in %s", folder)
    except ShardsUnusable as exc:
        if folder.exists():
            log.warning("rebuilding token shards in %s: %s", folder, exc)
        _build_shards(cfg, vocab_size, data_dir, key, folder)
        try:
            shards = load_shards(folder, key)
            tokenizer = _manifest_tokenizer(shards.manifest, cfg, data_dir)
        except ShardsUnusable as again:
            raise DataError(f"{folder}: token shards unusable right after building them ({again})") from None
    _check_vocab(cfg, tokenizer, vocab_size)
    for split in SPLITS:
        max_id = int(shards.manifest[split]["max_id"])
        if max_id >= vocab_size:
            raise DataError(f"{cfg.source} ({split} stream): token id {max_id} is >= vocab size {vocab_size}")
    return tokenizer, shards.train, shards.eval


def _build_shards(cfg: DataConfig, vocab_size: int, data_dir: Path, key: dict, folder: Path) -> None:
    """One pass over the source (two for a BPE, which must learn from the training texts first)."""
    tokenizer = _source_tokenizer(cfg, data_dir)
    _check_vocab(cfg, tokenizer, vocab_size)
    head = {"key": key, "tokenizer": _tokenizer_info(cfg, tokenizer, data_dir)}
    write_shards(cfg, tokenizer, data_dir, folder, head, hint="; set data.data_dir")


def write_shards(
    cfg: DataConfig,
    tokenizer: Tokenizer,
    data_dir: Path,
    folder: Path,
    head: dict[str, Any],
    files: dict[str, str] | None = None,
    hint: str = "",
) -> dict[str, Any]:
    """Tokenise every document of `cfg`'s source into a build beside `folder`, then install it as `folder`:
    the shards, `files` (name -> text: a tokenizer that travels with them) and the manifest (`head`, which
    names the key and tokenizer, plus what the build counted). Returns the manifest."""
    try:
        build = new_build(folder.parent)
    except OSError as exc:
        raise DataError(f"{folder.parent}: cannot write token shards ({exc}){hint}") from None
    try:
        for name, text in (files or {}).items():
            (build / name).write_text(text, encoding="utf-8")
        writers = {split: ShardWriter(build, split) for split in SPLITS}
        counts = dict.fromkeys(SPLITS, 0)
        docs = tqdm(
            iter_documents(cfg, data_dir),
            desc=f"tokenising {cfg.source}",
            unit=" docs",
            disable=None,  # a bar on a terminal's stderr; quiet in logs and tests
            mininterval=1.0,
            leave=False,
        )
        for chunk in _chunks(docs, ENCODE_DOCS):
            for split, part in zip(SPLITS, split_documents(chunk, cfg.eval_fraction), strict=True):
                if part:
                    writers[split].write(_encode(tokenizer, part))
                    counts[split] += len(part)
        _require_both_splits(cfg, counts)
        manifest = {
            "format": FORMAT,
            "source": cfg.source,
            "column": cfg.text_column,
            "dtype": DTYPE,
            **head,
            "documents": counts,
            **{split: writer.close() for split, writer in writers.items()},
        }
        install(build, folder, manifest)
    except OSError as exc:
        raise DataError(f"{folder}: cannot write token shards ({exc})") from None
    finally:
        shutil.rmtree(build, ignore_errors=True)  # gone already when installed
    log.info(
        "tokenised %s: %d train / %d eval documents, %d / %d tokens -> %s",
        cfg.source,
        counts["train"],
        counts["eval"],
        manifest["train"]["tokens"],
        manifest["eval"]["tokens"],
        folder,
    )
    return manifest


def _source_tokenizer(cfg: DataConfig, data_dir: Path) -> Tokenizer:
    if cfg.tokenizer != "bpe":
        return make_tokenizer(cfg, [], data_dir)
    pinned = load_pinned(cfg, data_dir)
    if pinned is not None:  # the run's own, fetched from the coordinator: nothing to learn, no texts held
        return pinned
    # BPE sees training documents only, so eval text never shapes the vocabulary. This pass holds the
    # training texts in memory: cap a large source with data.max_documents.
    texts: list[str] = []
    counts = dict.fromkeys(SPLITS, 0)
    for doc in iter_documents(cfg, data_dir):
        held = is_eval_key(doc.key, cfg.eval_fraction)
        counts["eval" if held else "train"] += 1
        if not held:
            texts.append(doc.text)
    _require_both_splits(cfg, counts)
    tokenizer = make_tokenizer(cfg, texts, data_dir)
    check_trained(cfg, tokenizer, data_dir)
    return tokenizer


def _require_both_splits(cfg: DataConfig, counts: dict[str, int]) -> None:
    total = sum(counts.values())
    if total == 0:
        raise DataError(f"{cfg.source}: no documents (every row or file is empty)")
    for which in ("eval", "train"):
        if not counts[which]:
            raise DataError(
                f"{cfg.source}: no document of {total} fell in the {which} split "
                f"(eval_fraction={cfg.eval_fraction}); add documents (or split large files)"
            )


def _check_vocab(cfg: DataConfig, tokenizer: Tokenizer, vocab_size: int) -> None:
    if tokenizer.vocab_size > vocab_size:
        raise DataError(
            f"{cfg.source}: tokenizer {tokenizer.name} has {tokenizer.vocab_size} ids, "
            f"more than the model vocab {vocab_size}"
        )


def _tokenizer_info(cfg: DataConfig, tokenizer: Tokenizer, data_dir: Path) -> dict[str, Any]:
    """What the manifest says about its tokenizer; a BPE is named by its file in the data dir and digest."""
    info: dict[str, Any] = {
        "kind": cfg.tokenizer,
        "name": tokenizer.name,
        "vocab_size": tokenizer.vocab_size,
        "eos_id": tokenizer.eos_id,
    }
    if isinstance(tokenizer, BpeTokenizer):
        path = tokenizer.path
        if path is None or path.parent != data_dir or not path.is_file():
            raise DataError(f"{data_dir}: cannot keep the BPE tokenizer there; set data.data_dir")
        info.update(file=path.name, sha256=_sha256(path))
    return info


def _manifest_tokenizer(manifest: dict[str, Any], cfg: DataConfig, data_dir: Path) -> Tokenizer:
    info = manifest.get("tokenizer")
    if not isinstance(info, dict) or info.get("kind") != cfg.tokenizer:
        raise ShardsUnusable(f"manifest of another tokenizer ({info!r}, not {cfg.tokenizer!r})")
    tokenizer: Tokenizer
    if cfg.tokenizer == "bpe":
        name = str(info.get("file"))
        path = data_dir / name
        if Path(name).name != name or not path.is_file() or _sha256(path) != info.get("sha256"):
            raise ShardsUnusable(f"BPE tokenizer file {name} is missing or changed")
        if is_pinned(cfg) and info.get("sha256") != cfg.tokenizer_sha256:
            raise ShardsUnusable(f"BPE tokenizer file {name} is not the run's pinned tokenizer")
        tokenizer = BpeTokenizer.load(path, path.stem)
    else:
        tokenizer = make_tokenizer(cfg, [], data_dir)
    found = (tokenizer.name, tokenizer.vocab_size, tokenizer.eos_id)
    if found != (info.get("name"), info.get("vocab_size"), info.get("eos_id")):
        raise ShardsUnusable(f"manifest of another tokenizer ({info.get('name')!r}, here {found[0]!r})")
    return tokenizer


def _chunks(docs: Iterable[Document], size: int) -> Iterator[list[Document]]:
    chunk: list[Document] = []
    for doc in docs:
        chunk.append(doc)
        if len(chunk) >= size:
            yield chunk
            chunk = []
    if chunk:
        yield chunk


def _sha256(path: Path) -> str:
    with path.open("rb") as fh:
        return hashlib.file_digest(fh, "sha256").hexdigest()


def _encode(tokenizer: Tokenizer, docs: Sequence[Document]) -> np.ndarray:
    """Concatenate documents, each followed by eos."""
    texts = [d.text for d in docs]
    if isinstance(tokenizer, ByteTokenizer):
        ids: list[np.ndarray] = [tokenizer.encode_array(t) for t in texts]
    elif isinstance(tokenizer, BpeTokenizer):
        ids = [np.asarray(x, dtype=np.uint16) for x in tokenizer.encode_batch(texts)]
    else:
        ids = [np.asarray(tokenizer.encode(t), dtype=np.uint16) for t in texts]
    eos = np.array([tokenizer.eos_id], dtype=np.uint16)
    parts = [p for x in ids for p in (x, eos)]
    return np.concatenate(parts).astype(np.uint16, copy=False)
