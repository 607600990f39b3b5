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

Weighted (`measure_weighted`, the report's "weighted"): the seal gives each contribution an integer weight
earned by verified history (docs/security.md, "Weight earned by verified history"): an identity with h
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
    weighted_median,
)
from hetnode.algo.sparseloco import SparseLoCoCodec  # noqa: E402
from hetnode.config import Config, replace  # noqa: E402
from hetnode.data import TokenDataset  # noqa: E402
from hetnode.errors import ConfigError  # noqa: E402
from hetnode.lab.sim.simulation import ReplicaSimulation, Swarm, SyncMethod  # noqa: E402
from hetnode.model import count_parameters  # noqa: E402
from hetnode.wire.sync_payload import decode_payload  # noqa: E402

log = logging.getLogger(__name__)

STRATEGIES = ("disjoint", "disjoint-split", "opposite", "boost")
# Attackers send twice the largest honest norm: above every honest norm (so Sybils raise the median the
# aggregator scales everyone to), within the verifier's norm screen (64x above the median) (docs/security.md).
ATTACK_SCALE = 2.0
Contribution = tuple[str, dict[str, SparseUpdate]]
MAJORITY = "majority"  # the weighted measurement's extra strategy: many tiny honest-like updates
MAJORITY_DIVISOR = 64.0  # each majority Sybil sends the mean honest update / 64
MAJORITY_MOVED = 0.12  # ... with its own 12 % of the positions per tile moved elsewhere in the tile


@dataclass(frozen=True)
class InfluencePlan:
    replicas: int  # R honest
    rounds: int  # honest rounds; influence is measured on each round's payloads
    batch_size: int
    inner_steps: int = 30
    topk: int = 64
    rules: tuple[str, ...] = AGGREGATION_RULES
    strategies: tuple[str, ...] = STRATEGIES
    histories: tuple[int, ...] = (0, 1, 2, 4, 8)  # the Sybils' verified rounds in the weighted measurement
    weighted_sybils: tuple[int, ...] = (1, 5)  # k there (not capped at R/2: weight, not headcount, binds)

    @property
    def max_sybils(self) -> int:
        return max(1, self.replicas // 2)

    @property
    def majority_sybils(self) -> int:
        """Sybils in the "majority" strategy: more than the honest replicas (5 against R = 4)."""
        return max(max(self.weighted_sybils), self.replicas + 1)


def earned_weight(history: int, full: int) -> int:
    """The weight earned by `history` verified rounds: 0 on probation (not sealed), then min(h, full)."""
    return 0 if history <= 0 else min(history, full)


def stated_bound(k: int, weight: int, replicas: int, full: int) -> float:
    """k·w / (k·w + R·F): the round's weight that k identities of weight w hold beside R honest at F."""
    return k * weight / (k * weight + replicas * full) if k * weight else 0.0


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
        built: dict[int, SparseUpdate] = {}  # per offset: Sybils on the same positions send the same payload
        for s in range(k):
            offset = (s * grid.k) % grid.tile_elems if strategy == "disjoint-split" else 0
            if offset + grid.k > grid.tile_elems:  # wrapped past the tile's end: the lowest-score ones again
                offset = 0
            if offset not in built:
                pos = order[:, offset : offset + grid.k]
                tiles = torch.zeros(grid.num_tiles, grid.tile_elems)
                tiles.scatter_(1, pos, signs.gather(1, pos))
                dense = grid.from_tiles(tiles)
                scale = ATTACK_SCALE * max(norms) / math.sqrt(grid.total_selected)
                built[offset] = codec.sparse(codec.compress(dense * scale))
            sybils[s][name] = built[offset]
    return [(f"~sybil-{s:03d}", sybils[s]) for s in range(k)]


def _majority(
    honest: list[Contribution], shapes: dict[str, tuple[int, ...]], codec: SparseLoCoCodec, k: int, seed: int
) -> list[Contribution]:
    """k "majority" Sybils: each the mean honest update on its largest positions per tile, its own
    ~`MAJORITY_MOVED` of them moved to other positions of the tile (the honest sign there, a typical kept
    magnitude), scaled to ‖mean honest update‖ / `MAJORITY_DIVISOR` per tensor, through the real codec."""
    gen = torch.Generator().manual_seed(seed)
    sybils: list[dict[str, SparseUpdate]] = [{} for _ in range(k)]
    for name, shape in shapes.items():
        mean = torch.zeros(math.prod(shape))
        for _, updates in honest:
            mean.index_add_(0, *updates[name])
        mean /= len(honest)
        grid = codec.grid(shape)
        tiles = grid.to_tiles(mean.reshape(shape))
        top = torch.topk(tiles.abs(), grid.k, dim=1).indices
        outside = torch.ones_like(tiles, dtype=torch.bool).scatter_(1, top, False)
        moved = min(grid.tile_elems - grid.k, max(1, round(MAJORITY_MOVED * grid.k)))
        stay = grid.k - moved
        typical = tiles.gather(1, top).abs().median(dim=1, keepdim=True).values
        target = float(mean.norm()) / MAJORITY_DIVISOR
        for s in range(k):
            keep = top.gather(1, torch.rand(top.shape, generator=gen).topk(stay, dim=1).indices)
            draw = torch.rand(tiles.shape, generator=gen).masked_fill_(~outside, -1.0)
            pos = torch.cat([keep, draw.topk(moved, dim=1).indices], dim=1)
            vals = tiles.gather(1, pos)
            vals[:, stay:] = torch.where(vals[:, stay:] < 0, -1.0, 1.0) * typical
            out = torch.zeros_like(tiles)
            out.scatter_(1, pos, vals)
            dense = grid.from_tiles(out)
            norm = float(dense.norm())
            sybils[s][name] = codec.sparse(codec.compress(dense * (target / norm) if norm > 0 else dense))
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
        (strategy, k): _attack(honest, shapes, codec, strategy, k, seed)
        for strategy in plan.strategies
        for k in plan.weighted_sybils
        if not (strategy == "disjoint-split" and k == 1)
    }
    crowd = _majority(honest, shapes, codec, plan.majority_sybils, seed)
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
        without = _flat(aggregate_sparse(honest, shapes, rule=rule, weights=honest_weights))
        effect = {}
        for label, (present, weights) in weightings.items():
            everyone, group = honest + present, {who for who, _ in present}
            with_ = _flat(aggregate_sparse(everyone, shapes, rule=rule, weights=weights))
            parts = contribution_parts(everyone, shapes, rule=rule, weights=weights)
            effect[label] = {
                "honest_share": 1.0 - attributed_share(parts, group, shapes),
                "delta_kept": float(with_.norm()) / float(without.norm()) if without.norm() > 0 else 1.0,
            }
        majority["rules"][rule] = effect
    return {"rules": rules, "majority": majority}


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
