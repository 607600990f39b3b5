"""`hetnode bench influence`: how much of a round's update one identity, or k Sybils, can steer
(docs/security.md, "Steer the update").

R honest replicas train for a few SparseLoCo rounds (in-process, `ReplicaSimulation`); each round's real
payloads are decoded, and attackers are added to that set with the knowledge of every honest payload (the
worst case: a peer that waits for the others before publishing). Attackers obey the wire format (exactly k
positions per tile, 2-bit values, through the real codec) and send twice the largest honest norm, so the
aggregator scales them to the median (which Sybils also push up). For every rule, strategy and k, with P_i
contributor i's part of Δ (`contribution_parts`: Δ = Σ_i P_i, each on its own support) and G the attackers:

    share = ‖Σ_{i∈G} P_i‖ / (‖Σ_{i∈G} P_i‖ + Σ_{i∉G} ‖P_i‖)   the attackers' share of the update's norm
    shift = d / (d + ‖Δ_without‖),  d = ‖Δ_with − Δ_without‖   black-box: how far adding them moved Δ
    push  = d / m,   m = ‖(per-tensor median contribution norms)‖  the same in units of one median peer

`share` is the headline (docs/security.md, "Steer the update", "one identity's share of the update's norm"):
under the plain mean each identity at the median norm holds exactly 1/N of it whatever the overlap, so a fair
k-identity group gets k/(R+k). `shift` also counts what an identity changes without steering (diluting the
others, raising the median norm), so an honest identity's own shift (leave-one-out) is its reference. Norms
run over all tensors. Strategies (`influence_attacks.py`; the worst per rule and k is reported; a lower bound
on the true worst case):
- disjoint: k positions per tile that the fewest honest peers chose, random signs shared by all Sybils
  (they add up on the same coordinates);
- disjoint-split: the same, each Sybil on its own positions (√k against per-selector averaging);
- opposite: the positions most honest peers chose, against the sign of the honest sum;
- boost: the same positions, with the sign of the largest honest value (stays inside a trimmed range).

Weighted (`influence_weighted.py`, the report's "weighted"): the seal gives each contribution an integer
weight earned by verified history (docs/security.md, "Weight earned by verified history"): an identity with h
verified rounds weighs min(h, F), F = `outer.probation_rounds`, and h = 0 is probation (not sealed: share 0).
Honest replicas weigh F; k Sybils with h rounds each weigh w = min(h, F) and hold at most the stated bound
k·w / (k·w + R·F) of the round's weight. For every rule, h in `histories` and k in `weighted_sybils`, the
Sybils' share (worst over the strategies above and "majority") is measured with those weights, beside that
bound.
- majority: more Sybils than honest replicas (max(k, R + 1)) each send the mean honest update scaled down
  `MAJORITY_DIVISOR`×, on its largest positions with its own ~`MAJORITY_MOVED` of them moved elsewhere in the
  tile (no two alike). By headcount they are the median norm, and every honest contribution is scaled down
  to it; by weight the median stays an honest norm. Reported per weighting: `norm_kept` (what the median-norm
  scaling leaves of the honest contributions, against the honest set alone: 1 = untouched), and per rule
  the honest parts' share of the update's norm and `delta_kept` = ‖Δ_with‖ / ‖Δ_without‖.
"""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from tqdm import tqdm  # noqa: E402

from hetnode.algo.aggregate import (  # noqa: E402
    SparseUpdate,
    aggregate_sparse,
    contribution_parts,
)
from hetnode.algo.sparseloco import SparseLoCoCodec  # noqa: E402
from hetnode.config import Config, replace  # noqa: E402
from hetnode.data import TokenDataset  # noqa: E402
from hetnode.errors import ConfigError  # noqa: E402
from hetnode.lab.experiments.influence_attacks import (  # noqa: E402
    Contribution,
    InfluencePlan,
    attack,
    attributed_share,
    effect,
    flat,
    median_size,
)
from hetnode.lab.experiments.influence_weighted import measure_weighted, plot_weighted, summarise_weighted  # noqa: E402
from hetnode.lab.sim.simulation import ReplicaSimulation, Swarm, SyncMethod  # noqa: E402
from hetnode.model import count_parameters  # noqa: E402
from hetnode.wire.sync_payload import decode_payload  # noqa: E402

log = logging.getLogger(__name__)


def plan_for(quick: bool, replicas: int | None = None, rounds: int | None = None) -> InfluencePlan:
    """--quick: tiny, R=4, 3 rounds; full: small, R=8, 2 rounds."""
    if replicas is not None and replicas < 2:
        raise ConfigError("--replicas", "replicas", f"must be >= 2, got {replicas}")
    if rounds is not None and rounds < 1:
        raise ConfigError("--rounds", "rounds", f"must be >= 1, got {rounds}")
    if quick:
        return InfluencePlan(replicas=replicas or 4, rounds=rounds or 3, batch_size=8)
    return InfluencePlan(replicas=replicas or 8, rounds=rounds or 2, batch_size=4)


def honest_rounds(config: Config, plan: InfluencePlan, progress: bool = True):
    """Yield (round, shapes, [(replica id, {tensor: (indices, values)})]) from a real in-process run."""
    dataset = TokenDataset.build(config.data, config.model.vocab_size, seed=config.run.seed)
    method = SyncMethod("honest", "sparseloco", inner_steps=plan.inner_steps, topk=plan.topk)
    sim = ReplicaSimulation(config, dataset, method, Swarm(anchors=plan.replicas))
    shapes = {n: s for spec in sim.specs.values() for n, s in spec.shapes.items()}
    for r in tqdm(range(plan.rounds), desc="honest rounds", unit="round", disable=not progress):
        sim.run_round()
        contributions = []
        for replica, messages in sorted(sim.last_outgoing.items()):
            sparse: dict[str, SparseUpdate] = {}
            for shard, spec in sim.specs.items():
                sparse.update(decode_payload(messages[shard], spec).sparse)
            contributions.append((replica, sparse))
        yield r + 1, shapes, contributions


def measure_round(
    honest: list[Contribution], shapes: dict[str, tuple[int, ...]], plan: InfluencePlan, seed: int = 0
) -> dict:
    """Per rule: the honest identities' own shares and, per strategy and k, the attackers' share, shift
    and push."""
    codec = SparseLoCoCodec(plan.topk, 64)
    size = median_size(honest, shapes)
    attacks = {
        (strategy, k): attack(honest, shapes, codec, strategy, k, seed)
        for strategy in plan.strategies
        for k in range(1, plan.max_sybils + 1)
        if not (strategy == "disjoint-split" and k == 1)  # the same as "disjoint" for one identity
    }
    out: dict[str, dict] = {}
    for rule in plan.rules:
        without = flat(aggregate_sparse(honest, shapes, rule=rule))
        parts = contribution_parts(honest, shapes, rule=rule)
        honest_shares = [attributed_share(parts, {who}, shapes) for who, _ in honest]
        honest_shifts = [
            effect(without, flat(aggregate_sparse(honest[:i] + honest[i + 1 :], shapes, rule=rule)))[1]
            for i in range(len(honest))
        ]
        by_strategy: dict[str, dict[int, dict[str, float]]] = {}
        for (strategy, k), sybils in attacks.items():
            everyone = honest + sybils
            d, shift = effect(flat(aggregate_sparse(everyone, shapes, rule=rule)), without)
            share = attributed_share(
                contribution_parts(everyone, shapes, rule=rule), {who for who, _ in sybils}, shapes
            )
            by_strategy.setdefault(strategy, {})[k] = {"share": share, "shift": shift, "push": d / size}
        out[rule] = {
            "update_norm": float(without.norm()),
            "median_size": size,
            "honest_share_mean": sum(honest_shares) / len(honest_shares),
            "honest_share_max": max(honest_shares),
            "honest_shift_mean": sum(honest_shifts) / len(honest_shifts),
            "by_strategy": by_strategy,
        }
    return out


def run_influence(config: Config, plan: InfluencePlan, out_dir: Path, progress: bool = True) -> dict:
    """Measure every round of `plan`; write influence.json and influence.png to `out_dir`."""
    out_dir.mkdir(parents=True, exist_ok=True)
    config = replace(config, "data", batch_size=plan.batch_size)
    start = time.perf_counter()
    per_round = []
    weighted_per_round = []
    full = config.outer.probation_rounds
    for round_, shapes, honest in honest_rounds(config, plan, progress):
        measured = measure_round(honest, shapes, plan, seed=config.run.seed + round_)
        per_round.append(measured)
        weighted_per_round.append(measure_weighted(honest, shapes, plan, full, seed=config.run.seed + round_))
        log.info("round %d measured", round_)
    rules = {rule: _summarise(plan, [r[rule] for r in per_round]) for rule in plan.rules}
    report = {
        "config": config.run.name,
        "parameters": count_parameters(config.model),
        "replicas": plan.replicas,
        "rounds": plan.rounds,
        "inner_steps": plan.inner_steps,
        "topk": plan.topk,
        "max_sybils": plan.max_sybils,
        "naive_share": {str(k): k / (plan.replicas + k) for k in range(1, plan.max_sybils + 1)},
        "rules": rules,
        "per_round": per_round,
        "weighted": summarise_weighted(plan, full, weighted_per_round),
        "weighted_per_round": weighted_per_round,
        "wall_seconds": time.perf_counter() - start,
    }
    (out_dir / "influence.json").write_text(json.dumps(report, indent=2))
    plot_influence(report, out_dir / "influence.png")
    plot_weighted(report, out_dir / "influence-weighted.png")
    return report


def _summarise(plan: InfluencePlan, rounds: list[dict]) -> dict:
    """Per k, the worst strategy and round by share (with its shift and push) and the largest shift and push
    of any strategy; honest shares averaged over rounds."""
    worst: dict[str, dict] = {}
    for k in range(1, plan.max_sybils + 1):
        best = {"share": -1.0, "shift": 0.0, "push": 0.0, "strategy": ""}
        most_shift = most_push = 0.0
        for r in rounds:
            for strategy, ks in r["by_strategy"].items():
                if k not in ks:
                    continue
                most_shift, most_push = max(most_shift, ks[k]["shift"]), max(most_push, ks[k]["push"])
                if ks[k]["share"] > best["share"]:
                    best = {**ks[k], "strategy": strategy}
        worst[str(k)] = {**best, "max_shift": most_shift, "max_push": most_push}
    n = len(rounds)
    return {
        "honest_share": sum(r["honest_share_mean"] for r in rounds) / n,
        "honest_share_max": max(r["honest_share_max"] for r in rounds),
        "honest_shift": sum(r["honest_shift_mean"] for r in rounds) / n,
        "one_identity": worst["1"],
        "sybils": worst,
    }


def plot_influence(report: dict, path: Path) -> None:
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 5))
    ks = [0] + [int(k) for k in report["naive_share"]]
    for rule, result in report["rules"].items():
        shares = [result["honest_share_max"]] + [result["sybils"][str(k)]["share"] for k in ks[1:]]
        left.plot(ks, shares, marker="o", label=rule)
        pushes = [0.0] + [result["sybils"][str(k)]["max_push"] for k in ks[1:]]
        right.plot(ks, pushes, marker="o", label=rule)
    left.plot(ks[1:], [report["naive_share"][str(k)] for k in ks[1:]], "k--", label="k/(R+k)")
    left.set_ylabel("share of the update's norm (k = 0: largest honest identity)")
    left.set_ylim(0, 1)
    right.set_ylabel("how far they move Δ, in median contribution norms")
    for ax in (left, right):
        ax.set_xticks(ks)
        ax.set_xlabel("attacking identities k (worst strategy)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(
        f"{report['config']} ({report['parameters'] / 1e6:.1f}M params), R={report['replicas']} honest, "
        f"{report['rounds']} rounds"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
