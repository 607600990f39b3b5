"""The weighted half of `hetnode bench influence` (`influence.py`): what k Sybils with h verified rounds
hold of a round's update when the seal weighs each contribution by its earned weight, beside the stated
bound, and the "majority" attack's effect on the honest contributions (docs/security.md, "Weight earned by
verified history")."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import torch  # noqa: E402

from hetnode.algo.aggregate import aggregate_sparse, contribution_parts, weighted_median  # noqa: E402
from hetnode.algo.sparseloco import SparseLoCoCodec  # noqa: E402
from hetnode.lab.experiments.influence_attacks import (  # noqa: E402
    MAJORITY,
    MAJORITY_DIVISOR,
    MAJORITY_MOVED,
    Contribution,
    InfluencePlan,
    attack,
    attributed_share,
    flat,
    majority_attack,
)


def earned_weight(history: int, full: int) -> int:
    """The weight earned by `history` verified rounds: 0 on probation (not sealed), then min(h, full)."""
    return 0 if history <= 0 else min(history, full)


def stated_bound(k: int, weight: int, replicas: int, full: int) -> float:
    """k·w / (k·w + R·F): the round's weight that k identities of weight w hold beside R honest at F."""
    return k * weight / (k * weight + replicas * full) if k * weight else 0.0


def norm_kept(
    honest: list[Contribution], others: list[Contribution], weights: dict[str, int] | None
) -> float:
    """Σ_honest ‖v_i after the median-norm scaling‖ among honest + others (with `weights`), over the same
    among the honest alone (1: the others leave the honest contributions as they were)."""

    def kept(contributions: list[Contribution]) -> float:
        total = 0.0
        for name in honest[0][1]:
            norms = torch.stack([updates[name][1].norm() for _, updates in contributions])
            held = [1 if weights is None else weights[who] for who, _ in contributions]
            median = float(weighted_median(norms, held))
            total += sum(min(float(n), median) for n in norms[: len(honest)])
        return total

    alone = kept(honest)
    return kept(honest + others) / alone if alone > 0 else 1.0


def measure_weighted(
    honest: list[Contribution],
    shapes: dict[str, tuple[int, ...]],
    plan: InfluencePlan,
    full: int,
    seed: int = 0,
) -> dict:
    """Per rule, Sybil history h and k: the Sybils' share with weights {honest: F, Sybil: min(h, F)} (per
    strategy, "majority" included), beside `stated_bound`; and the "majority" attack's effect on the honest
    contributions by headcount and per h."""
    codec = SparseLoCoCodec(plan.topk, 64)
    attacks = {
        (strategy, k): attack(honest, shapes, codec, strategy, k, seed)
        for strategy in plan.strategies
        for k in plan.weighted_sybils
        if not (strategy == "disjoint-split" and k == 1)
    }
    crowd = majority_attack(honest, shapes, codec, plan.majority_sybils, seed)
    for k in plan.weighted_sybils:
        attacks[MAJORITY, k] = crowd[:k]
    honest_weights = {who: full for who, _ in honest}
    replicas = len(honest)

    def weights_for(sybils: list[Contribution], weight: int) -> dict[str, int]:
        return honest_weights | {who: weight for who, _ in sybils}

    # label -> (the Sybils in the aggregate, the weights): by headcount, then per h (none on probation)
    weightings: dict[str, tuple[list[Contribution], dict[str, int] | None]] = {"headcount": (crowd, None)}
    for h in plan.histories:
        weight = earned_weight(h, full)
        weightings[str(h)] = (crowd, weights_for(crowd, weight)) if weight else ([], honest_weights)
    majority = {
        "sybils": len(crowd),
        "norm_kept": {label: norm_kept(honest, crowd_, w) for label, (crowd_, w) in weightings.items()},
        "rules": {},
    }
    rules: dict[str, dict] = {}
    for rule in plan.rules:
        by_h: dict[str, dict] = {}
        for h in plan.histories:
            weight = earned_weight(h, full)
            by_k: dict[str, dict] = {}
            for k in plan.weighted_sybils:
                shares = {}
                for (strategy, kk), sybils in attacks.items():
                    if kk != k or not weight:  # on probation: not in the aggregate at all
                        continue
                    parts = contribution_parts(
                        honest + sybils, shapes, rule=rule, weights=weights_for(sybils, weight)
                    )
                    shares[strategy] = attributed_share(parts, {who for who, _ in sybils}, shapes)
                worst = max(shares, key=shares.__getitem__) if shares else ""
                by_k[str(k)] = {
                    "weight": weight,
                    "share": shares.get(worst, 0.0),
                    "strategy": worst,
                    "bound": stated_bound(k, weight, replicas, full),
                    "by_strategy": shares,
                }
            by_h[str(h)] = by_k
        rules[rule] = by_h
        without = flat(aggregate_sparse(honest, shapes, rule=rule, weights=honest_weights))
        effect = {}
        for label, (present, weights) in weightings.items():
            everyone, group = honest + present, {who for who, _ in present}
            with_ = flat(aggregate_sparse(everyone, shapes, rule=rule, weights=weights))
            parts = contribution_parts(everyone, shapes, rule=rule, weights=weights)
            effect[label] = {
                "honest_share": 1.0 - attributed_share(parts, group, shapes),
                "delta_kept": float(with_.norm()) / float(without.norm()) if without.norm() > 0 else 1.0,
            }
        majority["rules"][rule] = effect
    return {"rules": rules, "majority": majority}


def summarise_weighted(plan: InfluencePlan, full: int, rounds: list[dict]) -> dict:
    """The worst round of `measure_weighted` per rule, h and k (largest Sybil share, with its strategy), and
    for "majority" the smallest honest share, `delta_kept` and `norm_kept` of any round."""
    rules: dict[str, dict] = {}
    for rule in plan.rules:
        rules[rule] = {}
        for h in map(str, plan.histories):
            rules[rule][h] = {}
            for k in map(str, plan.weighted_sybils):
                cells = [r["rules"][rule][h][k] for r in rounds]
                worst = max(cells, key=lambda c: c["share"])
                rules[rule][h][k] = {
                    "weight": worst["weight"],
                    "share": worst["share"],
                    "strategy": worst["strategy"],
                    "bound": worst["bound"],
                    "share_over_bound": worst["share"] / worst["bound"] if worst["bound"] else 0.0,
                }
    labels = list(rounds[0]["majority"]["norm_kept"])
    majority = {
        "sybils": rounds[0]["majority"]["sybils"],
        "divisor": MAJORITY_DIVISOR,
        "moved": MAJORITY_MOVED,
        "norm_kept": {label: min(r["majority"]["norm_kept"][label] for r in rounds) for label in labels},
        "rules": {
            rule: {
                label: {
                    key: min(r["majority"]["rules"][rule][label][key] for r in rounds)
                    for key in ("honest_share", "delta_kept")
                }
                for label in labels
            }
            for rule in plan.rules
        },
    }
    return {
        "full_weight": full,
        "honest_weight": full,
        "replicas": plan.replicas,
        "histories": list(plan.histories),
        "sybils": list(plan.weighted_sybils),
        "strategies": [*plan.strategies, MAJORITY],
        "rules": rules,
        "majority": majority,
    }


def plot_weighted(report: dict, path: Path) -> None:
    """Sybil share vs history h (k = each of `sybils`), one line per rule, the stated bound dashed; and the
    "majority" attack's ‖Δ‖ kept vs h, headcount as a dotted line."""
    weighted = report["weighted"]
    hs = weighted["histories"]
    panels = len(weighted["sybils"]) + 1
    fig, axes = plt.subplots(1, panels, figsize=(5.5 * panels, 4.8))
    markers = dict(zip(weighted["rules"], "osD^v*", strict=False))  # rules that coincide stay visible
    for ax, k in zip(axes, map(str, weighted["sybils"]), strict=False):
        for rule, by_h in weighted["rules"].items():
            shares = [by_h[str(h)][k]["share"] for h in hs]
            ax.plot(hs, shares, marker=markers[rule], fillstyle="none", label=rule)
        first = next(iter(weighted["rules"].values()))
        ax.plot(hs, [first[str(h)][k]["bound"] for h in hs], "k--", label="k·w/(k·w+R·F)")
        ax.set_title(f"k = {k} Sybils of weight min(h, F={weighted['full_weight']})")
        ax.set_ylabel("Sybils' share of the update's norm (worst strategy)")
        ax.set_ylim(0, 1)
    majority = weighted["majority"]
    last = axes[-1]
    for rule, effect in majority["rules"].items():
        kept = [effect[str(h)]["delta_kept"] for h in hs]
        (line,) = last.plot(hs, kept, marker=markers[rule], fillstyle="none", label=rule)
        last.axhline(effect["headcount"]["delta_kept"], color=line.get_color(), linestyle=":")
    last.set_yscale("log")
    last.set_title(f"majority: {majority['sybils']} Sybils at 1/{majority['divisor']:g} (dotted: headcount)")
    last.set_ylabel("‖Δ with them‖ / ‖Δ without them‖")
    for ax in axes:
        ax.set_xticks(hs)
        ax.set_xlabel("Sybils' verified rounds h (0: probation, not sealed)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(
        f"{report['config']} ({report['parameters'] / 1e6:.1f}M params), R={report['replicas']} honest at "
        f"weight F={weighted['full_weight']}, {report['rounds']} rounds"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
