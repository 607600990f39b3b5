"""The summary and figure of `hetnode bench overlap` (`overlap.py` says what is measured): the suggested
duplicate threshold, at least `MARGIN` above every honest pair overlap seen, and which perturbed copies it
still catches against the verifier's rule of today."""

from __future__ import annotations

import math
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

CURRENT_THRESHOLD = 0.9  # the verifier's copy rule today (hetnode/algo/scoring.py, bootstrap/verifier.py)
MARGIN = 0.05  # the suggested threshold sits at least this far above the largest honest pair overlap
STEP = 0.05  # ... rounded up to a multiple of this


def ceil_step(x: float) -> float:
    return round(math.ceil(round(x / STEP, 9)) * STEP, 4)


def suggest(by_replicas: dict[str, dict], fractions: tuple[float, ...]) -> dict:
    """The smallest multiple of STEP at least MARGIN above every honest pair overlap (and the same for the
    cosine), and which perturbed copies each still catches."""
    rounds = [r for result in by_replicas.values() for r in result["rounds"]]
    pair_max = max(r["pairs"]["overlap"]["max"] for r in rounds)
    cos_max = max(r["pairs"]["cosine"]["max"] for r in rounds)
    own = [r["own_previous"]["overlap"]["max"] for r in rounds if r["own_previous"]["overlap"]]
    own_cos = [r["own_previous"]["cosine"]["max"] for r in rounds if r["own_previous"]["cosine"]]
    threshold = min(1.0, ceil_step(pair_max + MARGIN))
    cos_threshold = min(1.0, ceil_step(cos_max + MARGIN))

    def lowest(f: float, key: str) -> float:
        return min(r["perturbed"][str(f)][key] for r in rounds)

    caught = [f for f in fractions if lowest(f, "overlap") >= threshold]
    caught_cos = [f for f in fractions if lowest(f, "cosine") >= cos_threshold]
    caught_now = [f for f in fractions if lowest(f, "overlap") >= CURRENT_THRESHOLD]
    high = pair_max >= 0.5
    # relative rule: a pair is grouped when it overlaps its round's median honest pair by more than
    # `relative`; the within-round spread is small next to how the level moves with round and batch size
    spread = max(r["pairs"]["overlap"]["max"] - r["pairs"]["overlap"]["median"] for r in rounds)
    relative = ceil_step(spread + MARGIN)
    caught_relative = [
        f
        for f in fractions
        if all(
            r["perturbed"][str(f)]["overlap"] >= r["pairs"]["overlap"]["median"] + relative for r in rounds
        )
    ]
    notes = [
        f"largest honest pair overlap {pair_max:.3f} (any R, any round); threshold = the next multiple of "
        f"{STEP} at least {MARGIN} above it",
        f"at {threshold} a perturbed copy is still grouped for f in {caught} (overlap ~ 1 - f); the current "
        f"rule ({CURRENT_THRESHOLD}) catches only f in {caught_now}",
    ]
    if high:
        notes.append(
            "honest pairs overlap a lot here (>= 0.5): replicas that start each round from the same θ "
            "pick correlated top-k positions; a position rule cannot separate copies perturbed beyond "
            f"f ~ {1 - threshold:.2f} from honest peers"
        )
    else:
        notes.append(
            f"honest pairs overlap far below the current rule ({pair_max:.3f} vs {CURRENT_THRESHOLD}): "
            "the gap leaves room to group at a much lower threshold"
        )
    if own and max(own) >= threshold:
        notes.append(
            f"a replica's own previous payload reaches overlap {max(own):.3f} >= the threshold: a "
            "cross-round replay rule would need its own threshold"
        )
    notes.append(
        f"within a round honest pairs sit within {spread:.3f} of the round's median pair, while the level "
        "moves with the round (falls as training goes on) and with the tokens per round (batch size, H): a "
        "fixed threshold holds only for the configuration measured; a relative rule (median pair overlap "
        f"of the round + {relative}) would catch f in {caught_relative}"
    )
    notes.append(
        f"cosine: largest honest pair {cos_max:.3f}; a perturbed copy keeps cosine ~ 1 - f (values move "
        "with their positions), so the cosine separates no better than positions against this attacker, "
        "but it does flag copies whose values were kept"
    )
    return {
        "index_overlap_threshold": threshold,
        "cosine_threshold": cos_threshold,
        "margin": MARGIN,
        "honest_pair_overlap_max": pair_max,
        "honest_pair_cosine_max": cos_max,
        "own_previous_overlap_max": max(own) if own else None,
        "own_previous_cosine_max": max(own_cos) if own_cos else None,
        "caught_fractions": caught,
        "caught_fractions_by_cosine": caught_cos,
        "caught_fractions_at_current_threshold": caught_now,
        "current_threshold": CURRENT_THRESHOLD,
        "honest_pair_spread_max": spread,
        "relative_threshold_over_round_median": relative,
        "caught_fractions_by_relative_rule": caught_relative,
        "honest_overlap_high": high,
        "notes": notes,
    }


def plot_overlap(report: dict, path: Path) -> None:
    fig, axes = plt.subplots(2, 2, figsize=(14, 10))
    (by_round, by_r), (cos_round, pert) = axes
    threshold = report["suggestion"]["index_overlap_threshold"]
    every = [r for result in report["by_replicas"].values() for r in result["rounds"]]
    random = every[0]["random_overlap"]
    for replicas, result in report["by_replicas"].items():
        rounds = result["rounds"]
        x = [r["round"] for r in rounds]
        for ax, key in ((by_round, "overlap"), (cos_round, "cosine")):
            (line,) = ax.plot(
                x, [r["pairs"][key]["max"] for r in rounds], marker="o", label=f"R={replicas} max"
            )
            ax.plot(
                x,
                [r["pairs"][key]["median"] for r in rounds],
                marker="x",
                linestyle="--",
                color=line.get_color(),
                label=f"R={replicas} median",
            )
            own = [(r["round"], r["own_previous"][key]["max"]) for r in rounds if r["own_previous"][key]]
            if own:
                ax.plot(
                    *zip(*own, strict=True),
                    marker="s",
                    linestyle=":",
                    color=line.get_color(),
                    alpha=0.6,
                    label=f"R={replicas} own previous round, max",
                )
    counts = [int(r) for r in report["by_replicas"]]
    for round_ in range(1, report["rounds"] + 1):
        at = [report["by_replicas"][str(c)]["rounds"][round_ - 1]["pairs"]["overlap"] for c in counts]
        (line,) = by_r.plot(counts, [a["max"] for a in at], marker="o", label=f"round {round_} max")
        by_r.plot(
            counts,
            [a["median"] for a in at],
            marker="x",
            linestyle="--",
            color=line.get_color(),
            label=f"round {round_} median",
        )
    fractions = report["fractions"]
    for key, style in (("overlap", "o-"), ("cosine", "s--")):
        pert.plot(
            fractions,
            [min(r["perturbed"][str(f)][key] for r in every) for f in fractions],
            style,
            label=f"perturbed copy vs original: {key} (lowest of all rounds)",
        )
    for ax in (by_round, by_r, pert):
        ax.axhline(threshold, color="red", label=f"suggested threshold {threshold}")
        ax.axhline(CURRENT_THRESHOLD, color="grey", linestyle="--", label=f"current rule {CURRENT_THRESHOLD}")
        ax.axhline(
            random, color="black", linestyle=":", linewidth=0.8, label=f"random positions {random:.3f}"
        )
    by_round.set_title("index overlap: honest pairs per round (and own previous round)")
    by_r.set_title("index overlap: honest pairs against R")
    cos_round.set_title("cosine of the sparse updates: honest pairs per round")
    pert.set_title("perturbed copy: share f of its positions moved within their tiles")
    by_round.set_xlabel("round")
    cos_round.set_xlabel("round")
    by_r.set_xlabel("R (honest replicas)")
    by_r.set_xscale("log", base=2)
    by_r.set_xticks(counts, [str(c) for c in counts])
    pert.set_xlabel("f")
    for ax in (by_round, cos_round):
        ax.set_xticks(range(1, report["rounds"] + 1))
    for ax in (by_round, by_r, cos_round, pert):
        ax.set_ylim(-0.05 if ax is cos_round else 0, 1.02)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7, ncol=2)
    fig.suptitle(
        f"{report['config']} ({report['parameters'] / 1e6:.1f}M params), H={report['inner_steps']}, "
        f"batch {report['batch_size']}, top-{report['topk']} of {report['tile']}x{report['tile']}"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
