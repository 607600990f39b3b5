"""Prepared token folders ("tokens:<folder>"): a large text source tokenised once, offline, with a tokenizer.

`prepare_tokens` (`hetnode data prepare`) trains the BPE on at most N training documents, writes it as
`tokenizer.json` and tokenises the whole source into shards beside it (the layout of `shards.py`; the
manifest names the tokenizer by sha256). A run names the folder as its source and pins that sha256 in
`data.tokenizer_sha256`, so a peer whose copy holds another tokenizer refuses it instead of training on ids
that mean other words; no peer trains a tokenizer of its own from a corpus this size. A copy of the folder
without its `tokenizer.json` takes the run's from the data cache, where a joining peer fetched it from the
coordinator (`pinned_tokenizer.py`).
"""

from __future__ import annotations

import hashlib
import itertools
import logging
from pathlib import Path
from typing import Any

import numpy as np

from hetnode.config import DataConfig
from hetnode.data.documents import is_eval_key
from hetnode.data.pinned_tokenizer import TOKENIZER_FILE, load_pinned
from hetnode.data.shards import SPLITS, ShardsUnusable, load_shards
from hetnode.data.sources import TOKEN_KINDS, iter_documents, parse_source, source_identity
from hetnode.data.streams import write_shards
from hetnode.data.tokenizer import BpeTokenizer, ByteTokenizer, Tokenizer, corpus_fingerprint
from hetnode.errors import DataConfigError, DataError

log = logging.getLogger(__name__)

PREPARE_HINT = "make it with `hetnode data prepare` (docs/operations.md, 'A large corpus')"


def prepare_tokens(cfg: DataConfig, out: Path, bpe_documents: int, data_dir: Path) -> dict[str, Any]:
    """Tokenise `cfg.source` into the new folder `out`; the BPE learns from its first `bpe_documents`
    training documents. Returns the manifest (with the tokenizer's sha256 under "tokenizer")."""
    kind, _ = parse_source(cfg.source)
    if kind in TOKEN_KINDS:
        raise DataConfigError(f"{cfg.source}: already tokenised; prepare reads a text source")
    if bpe_documents < 1:
        raise DataConfigError(f"the BPE needs at least one document to learn from, got {bpe_documents}")
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise DataConfigError(f"{out}: already exists and is not empty; remove it or pick another folder")
    files: dict[str, str] = {}
    if cfg.tokenizer == "bpe":
        tokenizer, trained_on = _train_bpe(cfg, bpe_documents, data_dir)
        text = tokenizer.to_json()
        files[TOKENIZER_FILE] = text
        sha = hashlib.sha256(text.encode("utf-8")).hexdigest()
        extra: dict[str, Any] = {"file": TOKENIZER_FILE, "sha256": sha, "documents": trained_on}
    else:
        tokenizer, extra = ByteTokenizer(), {}
    info = {
        "kind": cfg.tokenizer,
        "name": tokenizer.name,
        "vocab_size": tokenizer.vocab_size,
        "eos_id": tokenizer.eos_id,
        **extra,
    }
    key = {
        "data": source_identity(cfg),
        "tokenizer": cfg.tokenizer,
        "bpe_vocab_size": cfg.bpe_vocab_size if cfg.tokenizer == "bpe" else None,
        "eval_fraction": cfg.eval_fraction,
    }
    return write_shards(cfg, tokenizer, data_dir, out, {"key": key, "tokenizer": info}, files)


def _train_bpe(cfg: DataConfig, limit: int, data_dir: Path) -> tuple[BpeTokenizer, int]:
    """Training documents only (eval text never shapes the vocabulary), the first `limit` in source order:
    their text is held in memory while the BPE learns."""
    docs = (d.text for d in iter_documents(cfg, data_dir) if not is_eval_key(d.key, cfg.eval_fraction))
    texts = list(itertools.islice(docs, limit))
    if not texts:
        raise DataError(f"{cfg.source}: no training documents to learn a BPE from")
    name = f"bpe-{corpus_fingerprint(texts)[:16]}-v{cfg.bpe_vocab_size}"
    log.info("training BPE tokenizer (vocab %d) on %d documents", cfg.bpe_vocab_size, len(texts))
    return BpeTokenizer.train(texts, cfg.bpe_vocab_size, name), len(texts)


def prepared_streams(
    cfg: DataConfig, folder: Path, vocab_size: int, data_dir: Path
) -> tuple[Tokenizer, list[np.ndarray], list[np.ndarray]]:
    """The tokenizer and memory-mapped shards of a prepared folder, checked against the run's config; a
    folder without its tokenizer takes the run's pinned one from `data_dir` (the data cache)."""
    if not folder.is_dir():
        raise DataConfigError(f"{folder}: prepared token folder not found; {PREPARE_HINT}")
    try:
        shards = load_shards(folder, None)
    except ShardsUnusable as exc:
        raise DataError(f"{folder}: not a usable prepared token folder ({exc}); {PREPARE_HINT}") from None
    manifest = shards.manifest
    key, info = manifest.get("key"), manifest.get("tokenizer")
    if not isinstance(key, dict) or not isinstance(info, dict):
        raise DataError(f"{folder}: manifest names no key or tokenizer; {PREPARE_HINT}")
    for field in ("tokenizer", "eval_fraction") + (("bpe_vocab_size",) if cfg.tokenizer == "bpe" else ()):
        ours, theirs = getattr(cfg, field), key.get(field)
        if ours != theirs:
            raise DataConfigError(
                f"{folder}: prepared with data.{field} = {theirs!r}, the config says {ours!r}; "
                "set it to the folder's value or prepare the folder again"
            )
    tokenizer = _bpe(cfg, folder, info, data_dir) if cfg.tokenizer == "bpe" else _bytes(cfg, folder)
    found = (tokenizer.name, tokenizer.vocab_size, tokenizer.eos_id)
    if found != (info.get("name"), info.get("vocab_size"), info.get("eos_id")):
        raise DataError(
            f"{folder}: the manifest names another tokenizer ({info.get('name')!r}, here {found[0]!r})"
        )
    if tokenizer.vocab_size > vocab_size:
        raise DataConfigError(
            f"{folder}: tokenizer has {tokenizer.vocab_size} ids, more than model.vocab_size {vocab_size}"
        )
    for split in SPLITS:
        max_id = int(manifest[split]["max_id"])
        if max_id >= vocab_size:
            raise DataError(f"{folder} ({split} stream): token id {max_id} is >= vocab size {vocab_size}")
    return tokenizer, shards.train, shards.eval


def _bpe(cfg: DataConfig, folder: Path, info: dict[str, Any], data_dir: Path) -> BpeTokenizer:
    path = folder / TOKENIZER_FILE
    if info.get("file") != TOKENIZER_FILE:
        raise DataError(f"{folder}: the manifest names no {TOKENIZER_FILE}; {PREPARE_HINT}")
    if not path.is_file():
        return _fetched_bpe(cfg, folder, info, data_dir)
    with path.open("rb") as fh:
        sha = hashlib.file_digest(fh, "sha256").hexdigest()
    if sha != info.get("sha256"):
        raise DataError(f"{path}: sha256 {sha[:16]}… is not the manifest's: the copy is damaged")
    if not cfg.tokenizer_sha256:
        raise DataConfigError(
            f"{folder}: the run must pin its tokenizer so every peer checks its copy: "
            f'set data.tokenizer_sha256 = "{sha}"'
        )
    if sha != cfg.tokenizer_sha256:
        raise DataConfigError(
            f"{path}: sha256 {sha} is not the run's data.tokenizer_sha256 {cfg.tokenizer_sha256}: "
            "this folder was prepared with another tokenizer; copy the run's folder instead"
        )
    return BpeTokenizer.load(path, str(info.get("name")))


def _fetched_bpe(cfg: DataConfig, folder: Path, info: dict[str, Any], data_dir: Path) -> BpeTokenizer:
    """A copy of the folder without its tokenizer: the run's pinned one, if the shards were cut with it."""
    if not cfg.tokenizer_sha256:
        raise DataError(f"{folder}: no {TOKENIZER_FILE} beside the shards; {PREPARE_HINT}")
    if info.get("sha256") != cfg.tokenizer_sha256:
        raise DataConfigError(
            f"{folder}: prepared with the tokenizer of sha256 {info.get('sha256')!r}, not the run's "
            f"data.tokenizer_sha256 {cfg.tokenizer_sha256}: copy the run's folder instead"
        )
    tokenizer = load_pinned(cfg, data_dir, str(info.get("name")))  # the same bytes: the manifest's name
    if tokenizer is None:
        raise DataError(
            f"{folder}: no {TOKENIZER_FILE} beside the shards, and no copy of the run's tokenizer in "
            f"{data_dir} (`hetnode join` fetches it from the coordinator); copy the folder's {TOKENIZER_FILE}"
        )
    return tokenizer


def _bytes(cfg: DataConfig, folder: Path) -> ByteTokenizer:
    if cfg.tokenizer_sha256:
        raise DataConfigError(f"{folder}: data.tokenizer_sha256 is set but the byte tokenizer has no file")
    return ByteTokenizer()
