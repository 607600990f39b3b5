"""Aggregation of compressed pseudo-gradients and the outer optimiser steps (docs/sync.md).

Every replica must compute the bit-identical outer update from the same sealed set of contributions, so all
reductions here run in a fixed order: contributions sorted by contributor id, one contributor (or, for the
trimmed mean, one sorted rank) at a time, and within one contributor every coordinate appears at most once (no
order-dependent float accumulation). The aggregation rule bounds how far one identity can move θ
(docs/security.md, "Steer the update").

Weights: the seal gives each contribution an integer weight, earned by its author's verified history
(`bootstrap/standing.py`); every statistic here (the median norm, the clip bound, the means, the trim) is
taken over weight, not headcount, so identities without history cannot outvote those with it. Integers keep
the sums of weights exact, and equal weights give exactly the unweighted rule.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import torch

from hetnode.algo.aggregation_rules import (  # names live apart: no torch
    AGGREGATION_RULES,
    MAX_WEIGHT,
    AggregationRule,
)

SparseUpdate = tuple[torch.Tensor, torch.Tensor]  # (flat int64 indices, float32 values)
TRIM_FRACTION = 0.2  # "trimmed": b = max(1, ⌊0.2·N⌋) values dropped at each end of every coordinate (N ≥ 3)


def trim_count(senders: int) -> int:
    """Values the "trimmed" rule drops at each end of a coordinate with `senders` contributors (0 below 3)."""
    if senders < 3:
        return 0
    return max(1, int(TRIM_FRACTION * senders))


def _sorted_by_id(contributions: Sequence[tuple[str, dict]]) -> list[tuple[str, dict]]:
    ordered = sorted(contributions, key=lambda c: c[0])
    for (a, _), (b, _) in zip(ordered, ordered[1:], strict=False):
        if a == b:
            raise ValueError(f"duplicate contributor id {a!r}")
    return ordered


def _check_sparse(
    who: str, name: str, idx: torch.Tensor, vals: torch.Tensor, numel: int, device: torch.device
) -> SparseUpdate:
    idx = idx.reshape(-1).to(device=device, dtype=torch.int64)
    vals = vals.reshape(-1).to(device=device, dtype=torch.float32)
    if idx.numel() != vals.numel():
        raise ValueError(f"{who}/{name}: {idx.numel()} indices but {vals.numel()} values")
    if idx.numel():
        if int(idx.min()) < 0 or int(idx.max()) >= numel:
            raise ValueError(f"{who}/{name}: index out of range [0, {numel})")
        if torch.unique(idx).numel() != idx.numel():
            raise ValueError(f"{who}/{name}: duplicate indices")
        if not bool(torch.isfinite(vals).all()):
            raise ValueError(f"{who}/{name}: non-finite values")
    return idx, vals


def aggregate_sparse(
    contributions: Sequence[tuple[str, dict[str, SparseUpdate]]],
    shapes: dict[str, tuple[int, ...]],
    device: torch.device | str = "cpu",
    rule: AggregationRule = "mean",
    weights: Mapping[str, int] | None = None,
) -> dict[str, torch.Tensor]:
    """Dense float32 Δ per tensor from sparse contributions (docs/sync.md, "Compression", docs/security.md,
    "Steer the update").

    `weights`: contributor -> a positive integer (None: 1 each). Below, N counts weight: a contributor of
    weight w counts as w contributors sending the same values.

    Per tensor, first (every rule): each contributor's value vector is scaled down (never up) to the median
    L2 norm over the N contributors that sent that tensor, so one outlier cannot dominate the round. The
    median is the lower weighted median (for equal weights `torch.median`'s: the lower of the two middle
    values for an even count; deterministic, and it is an actual contributor's norm). Then, per coordinate
    j, with S_j the contributors that selected j:

    - "selectors": the mean over S_j (`scatter_reduce(mean)` semantics). A coordinate only one peer selected
      gets that peer's full value, so one identity on a support nobody else chose moves θ by the median norm.
    - "mean": Σ_{i∈S_j} v_ij / N, the mean over all contributors (an unselected coordinate counts as 0; the
      SparseLoCo paper's (1/R)Σ). One identity moves Δ by at most the median norm / N.
    - "pooled": Σ_{i∈S_j} v_ij / n̄, one divisor for the whole tensor: n̄ = (Σ_i |S_i|) / |∪_i S_i|, the mean
      number of selectors per selected coordinate. Every contributor's part is its vector / n̄, so one
      identity holds ≈ 1/N of the update's norm, as under "mean", while the step keeps the size it has
      under "selectors" (n̄ ≥ 1, so Δ is never larger than the plain sum).
    - "clip": every value is clamped to ±c, c the median over contributors of their largest |value| (after the
      norm scaling), then the mean over S_j: no identity's coordinate exceeds what a typical peer sends.
    - "trimmed": over all N contributors (0 for those that did not select j), the b = `trim_count(N)` largest
      and b smallest values are dropped and the rest averaged: Σ / (N − 2b).

    Unselected coordinates and tensors nobody sent are 0. Every rule is a function of the *set* of
    contributions: sums run one contributor (or one sorted rank) at a time with elementwise adds, so the
    result is bit-identical on every replica whatever the input order or the SIMD path.
    """
    device = torch.device(device)
    out: dict[str, torch.Tensor] = {}
    for name, shape, _, senders, held in _prepared(contributions, shapes, device, rule, weights):
        numel = math.prod(shape)
        if not senders:
            flat = torch.zeros(numel, dtype=torch.float32, device=device)
        elif rule == "trimmed" and len(set(held)) > 1:
            flat = torch.zeros(numel, dtype=torch.float32, device=device)
            support, table, _ = _trim_table(senders, device)
            values, kept, total = _weighted_trim(table, held)
            acc = values[0] * kept[0]
            for r in range(1, values.shape[0]):
                acc.add_(values[r] * kept[r])
            flat[support] = acc / total
        elif rule == "trimmed":
            flat = torch.zeros(numel, dtype=torch.float32, device=device)
            support, table, kept = _trim_table(senders, device)
            ranked = torch.sort(table, dim=0, stable=True).values[kept[0] : kept[1]]
            acc = ranked[0].clone()
            for r in range(1, ranked.shape[0]):
                acc.add_(ranked[r])
            flat[support] = acc / ranked.shape[0]
        else:
            total, count = _total_and_count(senders, held, numel, device)
            if rule == "mean":
                flat = total / sum(held)
            elif rule == "pooled":
                flat = total / _pooled_divisor(senders, held, count)
            else:
                flat = torch.where(count > 0, total / count.clamp(min=1.0), total)
        out[name] = flat.reshape(shape)
    return out


def contribution_parts(
    contributions: Sequence[tuple[str, dict[str, SparseUpdate]]],
    shapes: dict[str, tuple[int, ...]],
    rule: AggregationRule = "mean",
    weights: Mapping[str, int] | None = None,
) -> dict[str, dict[str, SparseUpdate]]:
    """Each contributor's part of `aggregate_sparse`'s Δ, sparse on its own support: the parts add up to Δ
    (up to float rounding; for the trimmed mean, a kept value of 0 is nobody's part).

    This is what a contributor steers: under "mean" its part is w · its value vector / N, under "selectors"
    w · each value divided by the weight of the peers that chose the coordinate, under "trimmed" only the
    weight of its values that survives the trim, / (N − 2b). For measurement (`hetnode bench influence`),
    not for rounds.
    """
    device = torch.device("cpu")
    parts: dict[str, dict[str, SparseUpdate]] = {who: {} for who, _ in contributions}
    for name, shape, who_sent, senders, held in _prepared(contributions, shapes, device, rule, weights):
        if not senders:
            continue
        if rule == "trimmed":
            support, table, _ = _trim_table(senders, device)
            order = torch.sort(table, dim=0, stable=True).indices
            _, kept, total = _weighted_trim(table, held)
            share = torch.zeros_like(table)
            share.scatter_(0, order, kept)  # the weight each sender keeps, back in its own row
            for row, (who, (idx, vals)) in enumerate(zip(who_sent, senders, strict=True)):
                parts[who][name] = (idx, vals * share[row, torch.searchsorted(support, idx)] / total)
            continue
        _, count = _total_and_count(senders, held, math.prod(shape), device)
        divisor = _pooled_divisor(senders, held, count) if rule == "pooled" else float(sum(held))
        for who, (idx, vals), w in zip(who_sent, senders, held, strict=True):
            if rule in ("mean", "pooled"):
                parts[who][name] = (idx, vals * w / divisor)
            else:
                parts[who][name] = (idx, vals * w / count[idx])
    return parts


def _checked_weights(
    contributions: Sequence[tuple[str, dict]], weights: Mapping[str, int] | None
) -> dict[str, int]:
    if weights is None:
        return {who: 1 for who, _ in contributions}
    out = {}
    for who, _ in contributions:
        w = weights.get(who)
        if not isinstance(w, int) or isinstance(w, bool) or not 1 <= w <= MAX_WEIGHT:
            raise ValueError(f"{who}: weight must be an integer in [1, {MAX_WEIGHT}], got {w!r}")
        out[who] = w
    return out


def _prepared(
    contributions: Sequence[tuple[str, dict[str, SparseUpdate]]],
    shapes: dict[str, tuple[int, ...]],
    device: torch.device,
    rule: str,
    weights: Mapping[str, int] | None,
):
    """Per tensor: (name, shape, sender ids, checked values scaled to the median norm and, for "clip",
    clamped, the senders' weights), senders in contributor-id order."""
    if rule not in AGGREGATION_RULES:
        raise ValueError(f"unknown aggregation rule {rule!r}; choose from {list(AGGREGATION_RULES)}")
    ordered = _sorted_by_id(contributions)
    weight_of = _checked_weights(ordered, weights)
    for who, updates in ordered:
        unknown = sorted(set(updates) - set(shapes))
        if unknown:
            raise ValueError(f"{who}: unknown tensors {unknown}")
    for name, shape in shapes.items():
        numel = math.prod(shape)
        who_sent = [who for who, updates in ordered if name in updates]
        senders = [
            _check_sparse(who, name, *updates[name], numel, device)
            for who, updates in ordered
            if name in updates
        ]
        held = [weight_of[who] for who in who_sent]
        if senders:
            senders = _scale_to_median_norm(senders, held)
        if senders and rule == "clip":
            peaks = torch.stack([v.abs().max() if v.numel() else v.new_zeros(()) for _, v in senders])
            bound = weighted_median(peaks, held)
            senders = [(idx, vals.clamp(-bound, bound)) for idx, vals in senders]
        yield name, shape, who_sent, senders, held


def weighted_median(values: torch.Tensor, weights: Sequence[int]) -> torch.Tensor:
    """The lower weighted median of a 1-D tensor: the smallest value whose cumulative weight (values in
    ascending order, ties in input order) reaches half the total. Equal weights: `torch.median`'s value."""
    order = torch.sort(values, stable=True).indices.tolist()
    total, cumulative = sum(weights), 0
    for i in order:
        cumulative += weights[i]
        if 2 * cumulative >= total:
            return values[i]
    raise ValueError("weighted_median of nothing")


def _total_and_count(
    senders: list[SparseUpdate], held: Sequence[int], numel: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """(Σ w·v, Σ w) per coordinate over its selectors (weight 1 adds the values themselves, exactly)."""
    total = torch.zeros(numel, dtype=torch.float32, device=device)
    count = torch.zeros(numel, dtype=torch.float32, device=device)
    for (idx, vals), w in zip(senders, held, strict=True):
        total.index_add_(0, idx, vals if w == 1 else vals * float(w))
        count.index_add_(0, idx, torch.full_like(vals, float(w)))
    return total, count


def _pooled_divisor(senders: list[SparseUpdate], held: Sequence[int], count: torch.Tensor) -> float:
    """n̄ = weighted selections / selected coordinates, from integers: the same float on every replica."""
    selected = int((count > 0).sum())
    selections = sum(idx.numel() * w for (idx, _), w in zip(senders, held, strict=True))
    return selections / selected if selected else 1.0


def _scale_to_median_norm(senders: list[SparseUpdate], held: Sequence[int]) -> list[SparseUpdate]:
    norms = torch.stack([torch.linalg.vector_norm(v) for _, v in senders])
    median = weighted_median(norms, held)
    return [
        (idx, vals * (median / norm) if norm > median else vals)
        for (idx, vals), norm in zip(senders, norms, strict=True)
    ]


def _weighted_trim(table: torch.Tensor, held: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor, float]:
    """The weighted trimmed mean's terms: each coordinate's values in ascending order, the weight each rank
    keeps once b = W · trim_count(N) / N of weight is cut at both ends (W the total weight, N the senders;
    equal weights cut exactly `trim_count(N)` values), and the kept total W − 2b."""
    n = table.shape[0]
    w = torch.tensor([float(x) for x in held], dtype=torch.float64, device=table.device)
    total = float(w.sum())
    cut = total * trim_count(n) / n
    values, order = torch.sort(table, dim=0, stable=True)
    ranked_w = w[order]  # [N, U]: the weight behind each rank
    upto = torch.cumsum(ranked_w, dim=0)
    kept = torch.minimum(upto, torch.tensor(total - cut)) - torch.maximum(upto - ranked_w, torch.tensor(cut))
    return values, kept.clamp(min=0.0).to(table.dtype), total - 2 * cut


def _trim_table(
    senders: list[SparseUpdate], device: torch.device
) -> tuple[torch.Tensor, torch.Tensor, tuple[int, int]]:
    """The trimmed mean's input: the union of the senders' supports (sorted), a [N, |union|] table of their
    values (0 where a sender did not select the coordinate) and the kept ranks [b, N − b).

    Sorting a coordinate's N values fixes their order whatever the senders' order (equal values are
    interchangeable), and the kept ranks are then added one rank at a time: no order-dependent reduction.
    """
    n = len(senders)
    b = trim_count(n)
    support = torch.unique(torch.cat([idx for idx, _ in senders]))  # sorted
    table = torch.zeros(n, support.numel(), dtype=torch.float32, device=device)
    for row, (idx, vals) in enumerate(senders):
        # + 0.0 turns −0.0 into +0.0: the sort cannot tell the two apart, and a kept −0.0 would change a bit
        table[row, torch.searchsorted(support, idx)] = vals + 0.0
    return support, table, (b, n - b)


def aggregate_dense(contributions: Sequence[tuple[str, dict[str, torch.Tensor]]]) -> dict[str, torch.Tensor]:
    """Plain mean per tensor over the contributors that sent it, summed in contributor-id order (DiLoCo)."""
    ordered = _sorted_by_id(contributions)
    sums: dict[str, torch.Tensor] = {}
    counts: dict[str, int] = {}
    for who, updates in ordered:
        for name, t in updates.items():
            t = t.detach().to(torch.float32)
            if name not in sums:
                sums[name] = t.clone()
                counts[name] = 1
            elif t.shape != sums[name].shape:
                raise ValueError(f"{who}/{name}: shape {tuple(t.shape)} != {tuple(sums[name].shape)}")
            else:
                sums[name].add_(t.to(sums[name].device))
                counts[name] += 1
    return {name: s.div_(counts[name]) for name, s in sums.items()}


def _check_keys(params: dict[str, torch.Tensor], delta: dict[str, torch.Tensor]) -> None:
    if params.keys() != delta.keys():
        raise ValueError(f"params and delta differ in names: {sorted(set(params) ^ set(delta))}")


@torch.no_grad()
def outer_sgd_step(
    params: dict[str, torch.Tensor],
    delta: dict[str, torch.Tensor],
    lr: float = 1.0,
    weight_decay: float = 0.0,
) -> None:
    """θ ← θ − lr·Δ − lr·wd·θ in place (docs/sync.md, "One round": plain SGD outer step, α applied once).

    Decoupled weight decay uses the pre-step θ: implemented as θ ← θ·(1 − lr·wd), then θ ← θ − lr·Δ.
    This equals torch.optim.SGD(lr, weight_decay=wd) without momentum, up to float rounding.
    """
    _check_keys(params, delta)
    for name, p in params.items():
        if weight_decay:
            p.mul_(1.0 - lr * weight_decay)
        # α·Δ rounded on its own, then subtracted: `add_(alpha=)` may fuse the two (FMA) on one CPU and
        # not on another, and replicas on mixed hardware must agree bit for bit
        p.sub_(delta[name].to(device=p.device, dtype=p.dtype) * lr)


FLOAT32_MAX = float(torch.finfo(torch.float32).max)


@torch.no_grad()
def unsafe_outer_step(
    params: dict[str, torch.Tensor],
    delta: dict[str, torch.Tensor],
    lr: float = 1.0,
    weight_decay: float = 0.0,
) -> str | None:
    """The first tensor name for which `outer_sgd_step` could leave a non-finite value, else None.

    Checked before any parameter changes (all-or-nothing rounds, docs/security.md, "Crash the coordinator or a
    replica with one payload"): Δ must be finite and max|θ|·|1 − lr·wd| + lr·max|Δ| must stay below float32's
    largest value, which bounds every result.
    """
    _check_keys(params, delta)
    decay = abs(1.0 - lr * weight_decay) if weight_decay else 1.0
    for name, p in params.items():
        d = delta[name]
        if d.numel() == 0:
            continue
        if not bool(torch.isfinite(d).all()):
            return name
        bound = float(p.abs().max()) * decay + abs(lr) * float(d.abs().max())
        if not bound < FLOAT32_MAX:
            return name
    return None


class NesterovOuter:
    """DiLoCo's outer Nesterov SGD with Δ as the gradient (Douillard et al. 2023, arXiv:2311.08105).

    Same update as torch.optim.SGD(lr, momentum, nesterov=True, dampening=0): b ← μ·b + Δ (b = Δ at the first
    step), θ ← θ − lr·(Δ + μ·b). Kept explicit so a round's step never hides inside a library optimiser.
    """

    def __init__(self, lr: float = 0.7, momentum: float = 0.9) -> None:
        self.lr = lr
        self.momentum = momentum
        self.buffers: dict[str, torch.Tensor] = {}

    @torch.no_grad()
    def step(self, params: dict[str, torch.Tensor], delta: dict[str, torch.Tensor]) -> None:
        _check_keys(params, delta)
        for name, p in params.items():
            g = delta[name].to(device=p.device, dtype=p.dtype)
            buf = self.buffers.get(name)
            if buf is None:
                buf = g.clone()
                self.buffers[name] = buf
            else:
                buf.mul_(self.momentum).add_(g)
            p.add_(g.add(buf, alpha=self.momentum), alpha=-self.lr)

    def state_dict(self) -> dict[str, object]:
        return {
            "lr": self.lr,
            "momentum": self.momentum,
            "buffers": {n: b.detach().clone() for n, b in self.buffers.items()},
        }

    def load_state_dict(self, state: dict[str, object]) -> None:
        buffers = state["buffers"]
        if not isinstance(buffers, dict):
            raise ValueError("outer optimiser state: 'buffers' must be a dict")
        self.lr = float(state["lr"])  # type: ignore[arg-type]
        self.momentum = float(state["momentum"])  # type: ignore[arg-type]
        self.buffers = {str(n): torch.as_tensor(b).clone() for n, b in buffers.items()}
