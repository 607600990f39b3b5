"""The epoch guard: training refuses to start when its steps would pass over the training tokens more than
`train.max_epochs` times. A 178M-parameter model on the bundled 1M-token corpus memorises it in a few hundred
steps and its loss still falls, so nothing else would say the run learns nothing general."""

from __future__ import annotations

import math
from pathlib import Path

from hetnode.config import Config
from hetnode.data.dataset import TokenDataset
from hetnode.errors import ConfigError

OVERRIDE = "--allow-repeats (hetnode train, hetnode join) or train.max_epochs = 0"


def check_epochs(config: Config, train_tokens: int, max_steps: int | None = None) -> None:
    """Raise `ConfigError` (train.max_epochs) when max_steps · batch · seq > max_epochs · train_tokens."""
    limit = config.train.max_epochs
    if limit <= 0:
        return
    d = config.data
    steps = config.train.max_steps if max_steps is None else max_steps
    total = steps * d.batch_size * d.seq_len
    needed = math.ceil(total / limit)
    if train_tokens >= needed:
        return
    epochs = f"{total / train_tokens:,.1f}" if train_tokens > 0 else "infinitely many"
    raise ConfigError(
        f"run {config.run.name}",
        "train.max_epochs",
        f"{train_tokens:,} training tokens on hand (data.source {d.source!r}), but {steps:,} steps x batch "
        f"{d.batch_size} x seq {d.seq_len} = {total:,} tokens at most {limit:g} epochs need {needed:,} "
        f"({epochs} epochs here). Point data.source at more data (docs/operations.md, 'A large corpus'), "
        f"lower train.max_steps, or allow the repeats: {OVERRIDE}",
    )


def training_dataset(
    config: Config, max_steps: int | None = None, data_dir: Path | None = None
) -> TokenDataset:
    """The dataset a replica trains on (`TokenDataset.build`), refused by `check_epochs` when too small.
    Evaluation-only builds (the coordinator's) use `TokenDataset.build` and are never refused."""
    dataset = TokenDataset.build(config.data, config.model.vocab_size, config.run.seed, data_dir=data_dir)
    check_epochs(config, dataset.train_tokens, max_steps)
    return dataset
