"""The attackers of `hetnode bench influence` (`influence.py` says what is measured) and the measures of one
contribution group's part in a round's update.

Attackers obey the wire format (exactly k positions per tile, 2-bit values, through the real codec), built
with the knowledge of every honest payload of the round: `attack` for the strategies of `STRATEGIES`,
`majority_attack` for many tiny honest-like updates. `attributed_share` is the headline measure: a group's
share of the norm the aggregation rule hands out (`contribution_parts`: Δ = Σ_i P_i)."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from hetnode.algo.aggregate import AGGREGATION_RULES, SparseUpdate
from hetnode.algo.sparseloco import SparseLoCoCodec

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


def flat(delta: dict[str, torch.Tensor]) -> torch.Tensor:
    return torch.cat([delta[n].reshape(-1) for n in sorted(delta)])


def attack(
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


def majority_attack(
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


def median_size(honest: list[Contribution], shapes: dict[str, tuple[int, ...]]) -> float:
    """‖per-tensor median norms‖: how far one median contribution moves θ."""
    total = 0.0
    for name in shapes:
        norms = torch.stack([updates[name][1].norm() for _, updates in honest])
        total += float(torch.median(norms)) ** 2
    return math.sqrt(total)


def effect(with_: torch.Tensor, without: torch.Tensor) -> tuple[float, float]:
    """(d, shift): how far the attackers moved Δ, and d / (d + ‖Δ_without‖)."""
    d = float((with_ - without).norm())
    return d, d / (d + float(without.norm()))


def part_norms(
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
    mine, others = part_norms(parts, group, shapes)
    return mine / (mine + sum(others)) if mine + sum(others) > 0 else 0.0
