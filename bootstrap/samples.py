"""Short samples of text from the global θ, one per evaluated round, so people watching the status page see
the model learn (a loss curve says less to most of them).

The coordinator samples on the evaluator's model (a copy of the whole model on its `--device`, loaded with θ
of the round) right after evaluating, in its bookkeeping worker beside the seal (`bootstrap/bookkeeping.py`).
Each sample is seeded by run seed + round, so anyone holding θ of that round and the config gets the same
text on the same kind of device (CUDA's bf16 forwards may draw other tokens than CPU's fp32 ones).
A sample is kept in the round's evaluated line of `rounds.jsonl` (`"sample"`), so a restarted coordinator
shows the ones it had.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable, Mapping
from typing import Any

import torch

from hetnode.config import SamplesConfig
from hetnode.data.tokenizer import Tokenizer
from hetnode.model.decoder import DecoderStage
from hetnode.model.sampling import sample_tokens
from hetnode.training.precision import autocast_for

log = logging.getLogger(__name__)

SAMPLES_KEPT = 20  # shown on the status page and served by the API, newest first


class RoundSampler:
    """Samples `cfg.tokens` tokens after `cfg.prompt` from θ (nothing when `cfg.tokens` is 0)."""

    def __init__(self, cfg: SamplesConfig, run_seed: int, tokenizer: Tokenizer, model: DecoderStage) -> None:
        self.cfg = cfg
        self.run_seed = run_seed
        self.tokenizer = tokenizer
        self.model = model
        self.prompt_ids = tokenizer.encode(cfg.prompt) if cfg.tokens > 0 else []

    @property
    def enabled(self) -> bool:
        return self.cfg.tokens > 0 and bool(self.prompt_ids)

    @torch.no_grad()
    def sample(self, params: Mapping[str, torch.Tensor], round_: int) -> dict[str, Any] | None:
        """The sample of θ = `params` after `round_` (None when sampling is off), drawn on the model's
        device. Loads θ itself: the verifier shares the model and may have left other weights in it."""
        if not self.enabled:
            return None
        started = time.perf_counter()
        for name, param in self.model.named_parameters():
            if params[name].data_ptr() != param.data_ptr():  # the worker passes the model's own weights
                param.copy_(params[name])
        seed = self.run_seed + round_
        with autocast_for(next(self.model.parameters()).device):
            ids = sample_tokens(
                self.model,
                self.prompt_ids,
                self.cfg.tokens,
                temperature=self.cfg.temperature,
                seed=seed,
                stop_id=self.tokenizer.eos_id,
            )
        return {
            "prompt": self.cfg.prompt,
            "text": self.tokenizer.decode(ids),  # invalid UTF-8 is replaced, never raised
            "tokens": len(ids),
            "temperature": self.cfg.temperature,
            "seed": seed,
            "seconds": round(time.perf_counter() - started, 3),
        }


def newest_samples(history: Iterable[Mapping[str, Any]], n: int = SAMPLES_KEPT) -> list[dict[str, Any]]:
    """The samples of the newest `n` rounds that have one, newest first, each with its round."""
    found: list[dict[str, Any]] = []
    for entry in reversed(list(history)):
        sample = entry.get("sample")
        if isinstance(sample, Mapping):
            found.append({"round": entry.get("round")} | dict(sample))
            if len(found) >= n:
                break
    return found
