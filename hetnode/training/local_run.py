"""`hetnode train`: a local training run with progress bar, eval, checkpoints, metrics and a loss plot.

The run folder's layout and its checkpoints (the coordinator's format) are `run_checkpoints.py`'s."""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass
from pathlib import Path

from tqdm import tqdm

from hetnode.config import Config
from hetnode.data import training_dataset
from hetnode.model import build_model, count_parameters
from hetnode.training.plots import plot_losses
from hetnode.training.run_checkpoints import resume_run, save_run_checkpoint
from hetnode.training.trainer import InnerTrainer

log = logging.getLogger(__name__)

METRICS_NAME = "metrics.jsonl"
PLOT_NAME = "loss.png"


@dataclass(frozen=True)
class TrainSummary:
    steps: int
    tokens: int
    train_loss: float
    eval_loss: float
    first_eval_loss: float
    seconds: float
    tokens_per_second: float  # training steps only (evaluation and checkpoints excluded)
    out_dir: Path
    checkpoint: Path  # the folder `hetnode export` and `hetnode sample` read (`--from out_dir` finds it)


def run_local_training(
    config: Config,
    out_dir: Path,
    max_steps: int | None = None,
    resume: bool = False,
    device: str = "cpu",
    progress: bool = True,
) -> TrainSummary:
    """Train one replica alone until `max_steps` (default: config.train.max_steps)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    total_steps = max_steps if max_steps is not None else config.train.max_steps
    dataset = training_dataset(config, max_steps=total_steps)
    model = build_model(config.model, seed=config.run.seed)
    log.info("model: %.2fM parameters", count_parameters(config.model) / 1e6)
    trainer = InnerTrainer(config, model, dataset, device=device)

    metrics_path = out_dir / METRICS_NAME
    checkpoint, saved_step = None, -1
    if resume:
        checkpoint, saved_step = resume_run(out_dir, config, trainer), trainer.step
        log.info("resumed from %s at step %d", checkpoint, trainer.step)
    else:
        metrics_path.unlink(missing_ok=True)

    train_cfg = config.train
    first_eval = trainer.evaluate()
    eval_loss, train_loss = first_eval, float("nan")
    start, start_tokens, train_seconds = time.perf_counter(), trainer.tokens, 0.0
    with (
        metrics_path.open("a", encoding="utf-8") as metrics,
        tqdm(
            total=total_steps,
            initial=trainer.step,
            desc="train",
            unit="step",
            disable=not progress,
            leave=True,
        ) as bar,
    ):
        if trainer.step == 0:
            _write(metrics, step=0, loss=None, eval_loss=first_eval, tokens=0, seconds=0.0)
        while trainer.step < total_steps:
            step_start = time.perf_counter()
            result = trainer.train_step()
            # a host sync per step (the bar shows each loss, and a non-finite one raises at once): fine for
            # a local run; a swarm's anchor reads its loss once a round (`daemon/rounds.py`). Read before
            # the clock stops, so that on a GPU the step's time is its compute, not its launch
            train_loss = result.loss
            train_seconds += time.perf_counter() - step_start
            record = {
                "step": result.step,
                "loss": round(result.loss, 5),
                "tokens": trainer.tokens,
                "seconds": round(time.perf_counter() - start, 3),
            }
            if result.step % train_cfg.eval_every == 0 or result.step == total_steps:
                eval_loss = trainer.evaluate()
                record["eval_loss"] = round(eval_loss, 5)
            if result.step % train_cfg.log_every == 0 or "eval_loss" in record:
                _write(metrics, **record)
            if result.step % train_cfg.checkpoint_every == 0:
                checkpoint, saved_step = save_run_checkpoint(out_dir, config, trainer), trainer.step
            bar.set_postfix(loss=f"{result.loss:.3f}", eval=f"{eval_loss:.3f}", lr=f"{result.lr:.1e}")
            bar.update(1)
    if checkpoint is None or saved_step != trainer.step:
        checkpoint = save_run_checkpoint(out_dir, config, trainer)
    seconds = time.perf_counter() - start
    plot_losses(metrics_path, out_dir / PLOT_NAME, title=f"{config.run.name}: local training")
    done_tokens = trainer.tokens - start_tokens
    return TrainSummary(
        steps=trainer.step,
        tokens=trainer.tokens,
        train_loss=train_loss,
        eval_loss=eval_loss,
        first_eval_loss=first_eval,
        seconds=seconds,
        tokens_per_second=done_tokens / train_seconds if train_seconds > 0 else 0.0,
        out_dir=out_dir,
        checkpoint=checkpoint,
    )


def _write(stream, **record) -> None:
    stream.write(json.dumps({k: v for k, v in record.items() if v is not None}) + "\n")
    stream.flush()
