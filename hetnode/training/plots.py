"""PNG plots of training metrics (matplotlib, headless)."""

from __future__ import annotations

import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # no display on servers and CI
import matplotlib.pyplot as plt  # noqa: E402


def plot_losses(metrics_path: Path, out_path: Path, title: str) -> None:
    """Train loss (every logged step) and eval loss (every eval) against step."""
    train, evals = [], []
    for line in metrics_path.read_text(encoding="utf-8").splitlines():
        record = json.loads(line)
        if "loss" in record:
            train.append((record["step"], record["loss"]))
        if "eval_loss" in record:
            evals.append((record["step"], record["eval_loss"]))
    fig, ax = plt.subplots(figsize=(7, 4))
    if train:
        ax.plot(*zip(*train, strict=True), label="train loss", alpha=0.7)
    if evals:
        ax.plot(*zip(*evals, strict=True), "o-", label="eval loss")
    ax.set_xlabel("step")
    ax.set_ylabel("cross-entropy (nats/token)")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    if train or evals:  # a resume that took no step has nothing to label
        ax.legend()
    fig.tight_layout()
    fig.savefig(out_path, dpi=110)
    plt.close(fig)
