"""Tokenizers: raw UTF-8 bytes, or a byte-level BPE trained locally on the training texts.

Every peer of a run must map text to the same ids: the byte tokenizer is fixed by definition, and the BPE
is trained from the run's own training documents (deterministically) and cached under a name that changes
whenever the corpus or vocab size does. A run that pins its BPE by sha256 (`data.tokenizer_sha256`) trains
none on its peers: they take the coordinator's copy instead (`pinned_tokenizer.py`).
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Protocol, runtime_checkable

import numpy as np
from tokenizers import Tokenizer as HfTokenizer
from tokenizers import decoders, models, pre_tokenizers, trainers

from hetnode.config import DataConfig
from hetnode.errors import DataError
from hetnode.files import atomic_write_text

log = logging.getLogger(__name__)

END_OF_TEXT = "<|endoftext|>"


@runtime_checkable
class Tokenizer(Protocol):
    """What the data layer and sampling code need from a tokenizer."""

    @property
    def name(self) -> str: ...

    @property
    def vocab_size(self) -> int: ...

    @property
    def eos_id(self) -> int: ...

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: Sequence[int]) -> str: ...


class ByteTokenizer:
    """UTF-8 bytes 0..255 plus end-of-text 256: no training, no files, identical on every peer."""

    name = "bytes"
    vocab_size = 257
    eos_id = 256

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def encode_array(self, text: str) -> np.ndarray:
        """The fast path for tokenising a whole corpus (no per-byte Python ints)."""
        return np.frombuffer(text.encode("utf-8"), dtype=np.uint8)

    def decode(self, ids: Sequence[int]) -> str:
        """Skip end-of-text and any id a model may sample beyond the byte range; never raise on bad UTF-8."""
        return bytes(int(i) for i in ids if 0 <= int(i) < 256).decode("utf-8", errors="replace")

    def __repr__(self) -> str:
        return "ByteTokenizer()"


class BpeTokenizer:
    """Byte-level BPE (GPT-2 style) from the `tokenizers` package, with `<|endoftext|>` as eos."""

    def __init__(self, hf: HfTokenizer, name: str, path: Path | None = None) -> None:
        eos = hf.token_to_id(END_OF_TEXT)
        if eos is None:
            raise DataError(f"BPE tokenizer {path or name} has no {END_OF_TEXT} token")
        # Text that happens to contain "<|endoftext|>" must be encoded as text, not as a document boundary.
        hf.encode_special_tokens = True
        self._hf = hf
        self.name = name
        self.path = path
        self.vocab_size: int = hf.get_vocab_size()
        self.eos_id: int = eos

    @classmethod
    def train(cls, texts: Sequence[str], vocab_size: int, name: str = "bpe") -> BpeTokenizer:
        """Train on `texts` only; merges are picked by count with fixed tie-breaks, so peers agree."""
        hf = HfTokenizer(models.BPE())
        hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        hf.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(
            vocab_size=vocab_size,
            special_tokens=[END_OF_TEXT],
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
            show_progress=False,
        )
        hf.train_from_iterator(texts, trainer=trainer, length=len(texts))
        return cls(hf, name)

    @classmethod
    def load(cls, path: Path, name: str) -> BpeTokenizer:
        try:
            hf = HfTokenizer.from_file(str(path))
        except Exception as exc:  # the Rust side raises a bare Exception for a bad file
            raise DataError(f"{path}: not a readable tokenizer file ({exc}); delete it to retrain") from None
        return cls(hf, name, path)

    def save(self, path: Path) -> None:
        """Write atomically: several peers on one machine may share the data dir."""
        atomic_write_text(path, self.to_json())
        self.path = path

    def to_json(self) -> str:
        """The `tokenizers` JSON that `save` writes (what a coordinator serves beside its checkpoints)."""
        return self._hf.to_str()

    def encode(self, text: str) -> list[int]:
        return self._hf.encode(text).ids

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        """Tokenise many documents in parallel (Rust threads); used to build the token streams."""
        return [enc.ids for enc in self._hf.encode_batch(list(texts))]

    def decode(self, ids: Sequence[int]) -> str:
        return self._hf.decode([int(i) for i in ids if int(i) != self.eos_id], skip_special_tokens=True)

    def __repr__(self) -> str:
        return f"BpeTokenizer(name={self.name!r}, vocab_size={self.vocab_size})"


def corpus_fingerprint(texts: Sequence[str]) -> str:
    """A content hash of the training texts (order matters: it changes what BPE learns)."""
    h = hashlib.blake2b(digest_size=16)
    for text in texts:
        data = text.encode("utf-8")
        h.update(len(data).to_bytes(8, "little"))
        h.update(data)
    return h.hexdigest()


def bpe_cache_path(data_dir: Path, texts: Sequence[str], vocab_size: int) -> Path:
    return data_dir / f"bpe-{corpus_fingerprint(texts)[:16]}-v{vocab_size}.json"


def make_tokenizer(cfg: DataConfig, texts: Sequence[str], data_dir: Path) -> Tokenizer:
    """The tokenizer `cfg` asks for; a BPE comes from the data-dir cache, else is trained on `texts`."""
    if cfg.tokenizer == "bytes":
        return ByteTokenizer()
    if cfg.tokenizer != "bpe":
        raise DataError(f"unknown tokenizer {cfg.tokenizer!r} (expected 'bytes' or 'bpe')")
    if not texts:
        raise DataError(f"cannot train a BPE tokenizer for source {cfg.source!r}: no training texts")
    path = bpe_cache_path(data_dir, texts, cfg.bpe_vocab_size)
    name = path.stem
    if path.is_file():
        log.debug("loading BPE tokenizer from %s", path)
        return BpeTokenizer.load(path, name)
    log.info("training BPE tokenizer (vocab %d) on %d texts -> %s", cfg.bpe_vocab_size, len(texts), path)
    tok = BpeTokenizer.train(texts, cfg.bpe_vocab_size, name)
    try:
        tok.save(path)
    except OSError as exc:
        log.warning("could not cache BPE tokenizer at %s: %s", path, exc)
    return tok
