"""The demo report's PNGs, drawn from the summary alone (Agg backend: no display needed). Each plot copes
with no data at all (an interrupted start), one round, or many."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.ticker import MaxNLocator  # noqa: E402

PLOTS = {
    "eval loss per round": "loss.png",
    "bytes per round": "bytes.png",
    "contributions": "contributions.png",
}


def _empty(ax: Any, text: str) -> None:
    ax.text(0.5, 0.5, text, ha="center", va="center", transform=ax.transAxes, color="gray")
    ax.set_xticks([])
    ax.set_yticks([])


def _rounds_axis(ax: Any) -> None:
    ax.set_xlabel("sealed round")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))


def _save(fig: Any, path: Path) -> None:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_loss(summary: Mapping[str, Any], path: Path) -> None:
    points = [(r["round"], r["eval_loss"]) for r in summary["rounds"] if r["eval_loss"] is not None]
    fig, ax = plt.subplots(figsize=(6.4, 4))
    if points:
        ax.plot([p[0] for p in points], [p[1] for p in points], marker="o", color="tab:blue")
        _rounds_axis(ax)
        ax.set_ylabel("global eval loss (coordinator)")
        ax.grid(alpha=0.3)
    else:
        _empty(ax, "no sealed rounds")
    ax.set_title("global eval loss per round")
    _save(fig, path)


def plot_bytes(summary: Mapping[str, Any], path: Path) -> None:
    rounds = summary["rounds"]
    fig, ax = plt.subplots(figsize=(6.4, 4))
    series = (
        ("anchor", "anchors (SparseLoCo)", "tab:blue", "-"),
        ("stage", "chain stages (SparseLoCo)", "tab:green", "-"),
        ("dense", "dense fp32 equivalent", "tab:red", "--"),
    )
    drawn = False
    for key, label, color, style in series:
        points = [(r["round"], r["bytes"][key]) for r in rounds if r["bytes"][key] > 0]
        if points:
            xs, ys = [p[0] for p in points], [p[1] for p in points]
            ax.plot(xs, ys, marker="o", color=color, linestyle=style, label=label)
            drawn = True
    if drawn:
        ax.set_yscale("log")
        _rounds_axis(ax)
        ax.set_ylabel("bytes per round (all replicas of the class)")
        ax.legend()
        ax.grid(alpha=0.3, which="both")
    else:
        _empty(ax, "no payload bytes recorded")
    ax.set_title("bytes per round by replica class")
    _save(fig, path)


def plot_contributions(summary: Mapping[str, Any], path: Path) -> None:
    """Per peer: its replica's tokens (light) and the part credited to it (solid), labelled with its share
    of all credited tokens, as the report's contributions table says (docs/observability.md,
    Contribution credit)."""
    standings = [s for s in summary["contributions"] if s.get("share") is not None]
    fig, ax = plt.subplots(figsize=(6.4, max(3.0, 0.55 * len(standings) + 1.5)))
    if standings:
        rows = standings[::-1]
        names = [str(s["name"]) for s in rows]
        colors = ["tab:blue" if s.get("role") == "anchor" else "tab:green" for s in rows]
        ax.barh(names, [s.get("replica_tokens") or 0 for s in rows], color=colors, alpha=0.25)
        bars = ax.barh(names, [s.get("tokens") or 0 for s in rows], color=colors)
        labels = [f"{100 * float(s['share']):.1f} %" for s in rows]
        ax.bar_label(bars, labels=labels, padding=3, fontsize=8)
        ax.set_xlabel("tokens: credited (solid) of its replica's (light); label: share of all credited")
        ax.margins(x=0.15)
        ax.grid(alpha=0.3, axis="x")
    else:
        _empty(ax, "no contributions credited")
    ax.set_title("contributions (blue: anchors, green: chain stages)")
    _save(fig, path)


def write_plots(summary: Mapping[str, Any], out: Path) -> list[Path]:
    paths = [out / name for name in PLOTS.values()]
    for plot, path in zip((plot_loss, plot_bytes, plot_contributions), paths, strict=True):
        plot(summary, path)
    return paths
