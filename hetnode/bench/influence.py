"""`hetnode bench influence`: how much of a round's update one identity, or k Sybils, can steer (TRUST §3).

R honest replicas train for a few SparseLoCo rounds (in-process, `ReplicaSimulation`); each round's real
payloads are decoded, and attackers are added to that set with the knowledge of every honest payload (the
worst case: a peer that waits for the others before publishing). Attackers obey the wire format (exactly k
positions per tile, 2-bit values, through the real codec) and send twice the largest honest norm, so the
aggregator scales them to the median (which Sybils also push up). For every rule, strategy and k, with P_i
contributor i's part of Δ (`contribution_parts`: Δ = Σ_i P_i, each on its own support) and G the attackers:

    share = ‖Σ_{i∈G} P_i‖ / (‖Σ_{i∈G} P_i‖ + Σ_{i∉G} ‖P_i‖)   the attackers' share of the update's norm
    shift = d / (d + ‖Δ_without‖),  d = ‖Δ_with − Δ_without‖   black-box: how far adding them moved Δ
    push  = d / m,   m = ‖(per-tensor median contribution norms)‖  the same in units of one median peer

`share` is the headline (TRUST §3, "one identity's share of the update's norm"): under the plain mean each
identity at the median norm holds exactly 1/N of it whatever the overlap, so a fair k-identity group gets
k/(R+k). `shift` also counts what an identity changes without steering (diluting the others, raising the
median norm), so an honest identity's own shift (leave-one-out) is its reference. Norms run over all tensors.
Strategies (the worst per rule and k is reported; a lower bound on the true worst case):
- disjoint: k positions per tile that the fewest honest peers chose, random signs shared by all Sybils
  (they add up on the same coordinates);
- disjoint-split: the same, each Sybil on its own positions (√k against per-selector averaging);
- opposite: the positions most honest peers chose, against the sign of the honest sum;
- boost: the same positions, with the sign of the largest honest value (stays inside a trimmed range).
"""

from __future__ import annotations

import json
import logging
import math
import time
from dataclasses import dataclass
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import torch  # noqa: E402
from tqdm import tqdm  # noqa: E402

from hetnode.algo.aggregate import (  # noqa: E402
    AGGREGATION_RULES,
    SparseUpdate,
    aggregate_sparse,
    contribution_parts,
)
from hetnode.algo.sparseloco import SparseLoCoCodec  # noqa: E402
from hetnode.config import Config, replace  # noqa: E402
from hetnode.data import TokenDataset  # noqa: E402
from hetnode.errors import ConfigError  # noqa: E402
from hetnode.model import count_parameters  # noqa: E402
from hetnode.sim.simulation import ReplicaSimulation, Swarm, SyncMethod  # noqa: E402
from hetnode.wire.sync_payload import decode_payload  # noqa: E402

log = logging.getLogger(__name__)

STRATEGIES = ("disjoint", "disjoint-split", "opposite", "boost")
# Attackers send twice the largest honest norm: above every honest norm (so Sybils raise the median the
# aggregator scales everyone to), within the verifier's norm screen (64x above the median) (docs/security.md).
ATTACK_SCALE = 2.0
Contribution = tuple[str, dict[str, SparseUpdate]]


@dataclass(frozen=True)
class InfluencePlan:
    replicas: int  # R honest
    rounds: int  # honest rounds; influence is measured on each round's payloads
    batch_size: int
    inner_steps: int = 30
    topk: int = 64
    rules: tuple[str, ...] = AGGREGATION_RULES
    strategies: tuple[str, ...] = STRATEGIES

    @property
    def max_sybils(self) -> int:
        return max(1, self.replicas // 2)


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


def _flat(delta: dict[str, torch.Tensor]) -> torch.Tensor:
    return torch.cat([delta[n].reshape(-1) for n in sorted(delta)])


def _attack(
    honest: list[Contribution],
    shapes: dict[str, tuple[int, ...]],
    codec: SparseLoCoCodec,
    strategy: str,
    k: int,
    seed: int,
) -> list[Contribution]:
    """k Sybil contributions for `strategy`, built through the real codec (a valid payload each)."""
    gen = torch.Generator().manual_seed(seed)
    sybils: list[dict[str, SparseUpdate]] = [{} for _ in range(k)]
    for name, shape in shapes.items():
        numel = math.prod(shape)
        count = torch.zeros(numel)
        total = torch.zeros(numel)
        largest = torch.zeros(numel)
        norms = []
        for _, updates in honest:
            idx, vals = updates[name]
            count.index_add_(0, idx, torch.ones_like(vals))
            total.index_add_(0, idx, vals)
            bigger = vals.abs() > largest[idx].abs()
            largest[idx[bigger]] = vals[bigger]
            norms.append(float(vals.norm()))
        grid = codec.grid(shape)
        noise = torch.rand(numel, generator=gen) * 0.5  # random tie-break between equal counts
        if strategy.startswith("disjoint"):
            score = count + noise  # fewest selectors first
            sign = torch.where(torch.rand(numel, generator=gen) < 0.5, -1.0, 1.0)
        else:
            score = -(count + total.abs() / (total.abs().max() + 1e-30) * 0.5)  # most selectors first
            direction = -total if strategy == "opposite" else largest
            sign = torch.where(direction < 0, -1.0, 1.0)
        order = torch.argsort(grid.to_tiles(score.reshape(shape)), dim=1)  # ascending score, per tile
        signs = grid.to_tiles(sign.reshape(shape))
        for s in range(k):
            offset = (s * grid.k) % grid.tile_elems if strategy == "disjoint-split" else 0
            pos = order[:, offset : offset + grid.k]
            if pos.shape[1] < grid.k:  # wrapped past the tile's end: take the lowest-score ones again
                pos = order[:, : grid.k]
            tiles = torch.zeros(grid.num_tiles, grid.tile_elems)
            tiles.scatter_(1, pos, signs.gather(1, pos))
            dense = grid.from_tiles(tiles)
            scale = ATTACK_SCALE * max(norms) / math.sqrt(grid.total_selected)
            sybils[s][name] = codec.sparse(codec.compress(dense * scale))
    return [(f"~sybil-{s:03d}", sybils[s]) for s in range(k)]


def _median_size(honest: list[Contribution], shapes: dict[str, tuple[int, ...]]) -> float:
    """‖per-tensor median norms‖: how far one median contribution moves θ."""
    total = 0.0
    for name in shapes:
        norms = torch.stack([updates[name][1].norm() for _, updates in honest])
        total += float(torch.median(norms)) ** 2
    return math.sqrt(total)


def _effect(with_: torch.Tensor, without: torch.Tensor) -> tuple[float, float]:
    """(d, shift): how far the attackers moved Δ, and d / (d + ‖Δ_without‖)."""
    d = float((with_ - without).norm())
    return d, d / (d + float(without.norm()))


def _part_norms(
    parts: dict[str, dict[str, SparseUpdate]], group: set[str], shapes: dict
) -> tuple[float, list]:
    """(‖Σ_{i∈group} P_i‖ over all tensors, [‖P_i‖ for i outside the group])."""
    group_sq = 0.0
    for name, shape in shapes.items():
        acc = torch.zeros(math.prod(shape))
        for who in group:
            if name in parts[who]:
                acc.index_add_(0, *parts[who][name])
        group_sq += float(acc.square().sum())
    others = [
        math.sqrt(sum(float(vals.square().sum()) for _, vals in tensors.values()))
        for who, tensors in parts.items()
        if who not in group
    ]
    return math.sqrt(group_sq), others


def attributed_share(parts: dict[str, dict[str, SparseUpdate]], group: set[str], shapes: dict) -> float:
    """‖Σ_{i∈G} P_i‖ / (‖Σ_{i∈G} P_i‖ + Σ_{i∉G} ‖P_i‖): the group's share of the norm the rule hands out."""
    mine, others = _part_norms(parts, group, shapes)
    return mine / (mine + sum(others)) if mine + sum(others) > 0 else 0.0


def measure_round(
    honest: list[Contribution], shapes: dict[str, tuple[int, ...]], plan: InfluencePlan, seed: int = 0
) -> dict:
    """Per rule: the honest identities' own shares and, per strategy and k, the attackers' share, shift
    and push."""
    codec = SparseLoCoCodec(plan.topk, 64)
    size = _median_size(honest, shapes)
    attacks = {
        (strategy, k): _attack(honest, shapes, codec, strategy, k, seed)
        for strategy in plan.strategies
        for k in range(1, plan.max_sybils + 1)
        if not (strategy == "disjoint-split" and k == 1)  # the same as "disjoint" for one identity
    }
    out: dict[str, dict] = {}
    for rule in plan.rules:
        without = _flat(aggregate_sparse(honest, shapes, rule=rule))
        parts = contribution_parts(honest, shapes, rule=rule)
        honest_shares = [attributed_share(parts, {who}, shapes) for who, _ in honest]
        honest_shifts = [
            _effect(without, _flat(aggregate_sparse(honest[:i] + honest[i + 1 :], shapes, rule=rule)))[1]
            for i in range(len(honest))
        ]
        by_strategy: dict[str, dict[int, dict[str, float]]] = {}
        for (strategy, k), sybils in attacks.items():
            everyone = honest + sybils
            d, shift = _effect(_flat(aggregate_sparse(everyone, shapes, rule=rule)), without)
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
    for round_, shapes, honest in honest_rounds(config, plan, progress):
        measured = measure_round(honest, shapes, plan, seed=config.run.seed + round_)
        per_round.append(measured)
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
        "wall_seconds": time.perf_counter() - start,
    }
    (out_dir / "influence.json").write_text(json.dumps(report, indent=2))
    plot_influence(report, out_dir / "influence.png")
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
