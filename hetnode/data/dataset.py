"""Token streams, the held-out eval split, and the deterministic per-slot batch schedule.

Peers in a run never talk about data: each computes its batches from (seed, slot, step) alone. So
the schedule must be a pure function of those numbers and of the corpus, identical on every machine
(no Python `hash()`, no numpy Generator methods whose output may change between versions).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch

from hetnode.config import DataConfig
from hetnode.data.documents import is_eval_key, split_documents
from hetnode.data.prepared import prepared_streams
from hetnode.data.shards import windows
from hetnode.data.sources import load_token_file, parse_source
from hetnode.data.streams import document_streams
from hetnode.data.tokenizer import ByteTokenizer, Tokenizer
from hetnode.errors import DataError

log = logging.getLogger(__name__)

Batch = tuple[torch.Tensor, torch.Tensor]
__all__ = ["TokenDataset", "epoch_permutation", "is_eval_key", "split_documents"]


def epoch_permutation(num_windows: int, seed: int, epoch: int) -> np.ndarray:
    """Window order of one epoch. Raw PCG64 output is stable across numpy versions; Generator methods
    (permutation, shuffle) are not, and peers must agree on the order."""
    keys = np.random.PCG64(np.random.SeedSequence([seed, epoch])).random_raw(num_windows)
    return np.argsort(keys, kind="stable")


class TokenDataset:
    """Train and eval token streams (uint16) cut into windows of seq_len + 1 tokens."""

    def __init__(
        self,
        *,
        source: str,
        tokenizer: Tokenizer,
        train: np.ndarray | Sequence[np.ndarray],
        held_out: np.ndarray | Sequence[np.ndarray],
        seq_len: int,
        batch_size: int,
        seed: int,
    ) -> None:
        if seq_len < 1 or batch_size < 1 or seed < 0:
            raise ValueError(
                f"need seq_len >= 1, batch_size >= 1, seed >= 0 (got {seq_len}, {batch_size}, {seed})"
            )
        self.source = source
        self.tokenizer = tokenizer
        self.seq_len = seq_len
        self.batch_size = batch_size
        self.seed = seed
        # a stream is one array or its memory-mapped shards, read as one sequence
        train_shards = [train] if isinstance(train, np.ndarray) else list(train)
        eval_shards = [held_out] if isinstance(held_out, np.ndarray) else list(held_out)
        self.train_tokens = sum(int(a.size) for a in train_shards)
        self.eval_tokens = sum(int(a.size) for a in eval_shards)
        width = seq_len + 1
        self.num_train_windows = self.train_tokens // width
        self.num_eval_batches = self.eval_tokens // width // batch_size
        need = f"one batch needs {batch_size} x {width} = {batch_size * width} tokens"
        if self.num_train_windows < batch_size:
            raise DataError(f"{source}: too little training data ({self.train_tokens} tokens; {need})")
        if self.num_eval_batches < 1:
            raise DataError(
                f"{source}: eval split too small ({self.eval_tokens} tokens; {need}); "
                "raise data.eval_fraction or add data"
            )
        self._train = windows(train_shards, width, self.num_train_windows)
        self._eval = windows(eval_shards, width, self.num_eval_batches * batch_size)
        self._perms: dict[int, np.ndarray] = {}

    @classmethod
    def build(cls, cfg: DataConfig, vocab_size: int, seed: int, data_dir: Path | None = None) -> TokenDataset:
        """Load the source, split off eval, tokenise (or load cached streams), check ids < vocab_size."""
        if not 0 < vocab_size <= 65536:
            raise ValueError(f"vocab_size must be in [1, 65536] to store ids as uint16, got {vocab_size}")
        start = time.perf_counter()
        data_dir = Path(data_dir) if data_dir is not None else Path(cfg.data_dir).expanduser()
        kind, path = parse_source(cfg.source)
        if kind == "bin" and path is not None:
            tokenizer, train, held = _bin_streams(cfg, path, vocab_size)
        elif kind == "tokens" and path is not None:
            tokenizer, train, held = prepared_streams(cfg, path, vocab_size, data_dir)
        else:
            tokenizer, train, held = document_streams(cfg, vocab_size, data_dir)
        dataset = cls(
            source=cfg.source,
            tokenizer=tokenizer,
            train=train,
            held_out=held,
            seq_len=cfg.seq_len,
            batch_size=cfg.batch_size,
            seed=seed,
        )
        log.info("%s (%.2f s)", dataset.describe(), time.perf_counter() - start)
        return dataset

    def windows_for(self, slot: int, num_slots: int, step: int) -> np.ndarray:
        """Window ids of the batch of (slot, step): positions (step*num_slots + slot)*B .. +B of the epochs.

        Each epoch is a seeded permutation of all windows, truncated to a whole number of steps
        (a multiple of num_slots*B), so no batch straddles two epochs: slots never share a window at
        a step and no window repeats within an epoch. The few dropped windows differ per epoch.
        """
        if num_slots < 1:
            raise ValueError(f"num_slots must be >= 1, got {num_slots}")
        if not 0 <= slot < num_slots:
            raise ValueError(f"slot must be in [0, {num_slots}), got {slot}")
        if step < 0:
            raise ValueError(f"step must be >= 0, got {step}")
        per_step = num_slots * self.batch_size
        steps_per_epoch = self.num_train_windows // per_step
        if steps_per_epoch == 0:
            raise DataError(
                f"{self.source}: {self.num_train_windows} training windows cannot feed "
                f"{num_slots} slots x batch {self.batch_size} in one step"
            )
        epoch, step_in_epoch = divmod(step, steps_per_epoch)
        offset = step_in_epoch * per_step + slot * self.batch_size
        return self._permutation(epoch)[offset : offset + self.batch_size].copy()

    def train_batch(self, slot: int, num_slots: int, step: int) -> Batch:
        """(inputs, targets), LongTensor [B, seq_len] each; pure in (seed, slot, num_slots, step)."""
        windows = self._train[self.windows_for(slot, num_slots, step)]
        return _to_batch(windows)

    def eval_batches(self, n: int) -> list[Batch]:
        """The first min(n, available) eval batches in stream order: the same every call, on every peer."""
        if n < 1:
            raise ValueError(f"n must be >= 1, got {n}")
        b = self.batch_size
        return [_to_batch(self._eval[i * b : (i + 1) * b]) for i in range(min(n, self.num_eval_batches))]

    def describe(self) -> str:
        tok = self.tokenizer
        return (
            f"data source={self.source} tokenizer={tok.name} (vocab {tok.vocab_size}) "
            f"train={self.train_tokens:,} tokens "
            f"({self.num_train_windows:,} windows of {self.seq_len + 1}) "
            f"eval={self.eval_tokens:,} tokens ({self.num_eval_batches} batches of {self.batch_size})"
        )

    def _permutation(self, epoch: int) -> np.ndarray:
        perm = self._perms.get(epoch)
        if perm is None:
            if len(self._perms) >= 2:  # consecutive steps touch at most two epochs
                self._perms.pop(min(self._perms))
            perm = self._perms[epoch] = epoch_permutation(self.num_train_windows, self.seed, epoch)
        return perm


def _to_batch(rows: np.ndarray) -> Batch:
    inputs = torch.from_numpy(np.asarray(rows[:, :-1], dtype=np.int64))
    targets = torch.from_numpy(np.asarray(rows[:, 1:], dtype=np.int64))
    return inputs, targets


def _bin_streams(cfg: DataConfig, path: Path, vocab_size: int) -> tuple[Tokenizer, np.ndarray, np.ndarray]:
    """A pre-tokenised stream has no documents, so its last eval_fraction is the held-out split."""
    if cfg.tokenizer != "bytes":
        raise DataError(
            f"{path}: a 'bin:' source is already tokenised; a BPE cannot be trained without "
            "text (set data.tokenizer = 'bytes')"
        )
    tokens = load_token_file(path, vocab_size)
    n_eval = int(round(tokens.size * cfg.eval_fraction))
    if n_eval < 1 or n_eval >= tokens.size:
        raise DataError(
            f"{path}: {tokens.size} tokens are too few to split off an eval fraction of {cfg.eval_fraction}"
        )
    split = tokens.size - n_eval
    return ByteTokenizer(), tokens[:split], tokens[split:]
