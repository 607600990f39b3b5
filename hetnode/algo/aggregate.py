"""Aggregation of compressed pseudo-gradients and the outer optimiser steps (DESIGN §2.1–2.2).

Every replica must compute the bit-identical outer update from the same sealed set of contributions, so all
reductions here run in a fixed order: contributions sorted by contributor id, one contributor at a time, and
within one contributor every coordinate appears at most once (no order-dependent float accumulation).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

SparseUpdate = tuple[torch.Tensor, torch.Tensor]  # (flat int64 indices, float32 values)


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
) -> dict[str, torch.Tensor]:
    """Dense float32 Δ per tensor from sparse contributions (DESIGN §2.2).

    Per tensor: each contributor's value vector is scaled down (never up) to the median L2 norm over the
    contributors that sent that tensor, so one outlier cannot dominate the round. The median is
    `torch.median` (the lower of the two middle values for an even count: deterministic, and it is an actual
    contributor's norm). Then each coordinate gets the mean over the contributors that selected it
    (`scatter_reduce(mean)` semantics); unselected coordinates and tensors nobody sent are 0.
    """
    device = torch.device(device)
    ordered = _sorted_by_id(contributions)
    for who, updates in ordered:
        unknown = sorted(set(updates) - set(shapes))
        if unknown:
            raise ValueError(f"{who}: unknown tensors {unknown}")
    out: dict[str, torch.Tensor] = {}
    for name, shape in shapes.items():
        numel = math.prod(shape)
        senders = [
            _check_sparse(who, name, *updates[name], numel, device)
            for who, updates in ordered
            if name in updates
        ]
        total = torch.zeros(numel, dtype=torch.float32, device=device)
        count = torch.zeros(numel, dtype=torch.float32, device=device)
        if senders:
            norms = torch.stack([torch.linalg.vector_norm(v) for _, v in senders])
            median = torch.median(norms)
            for (idx, vals), norm in zip(senders, norms, strict=True):
                if norm > median:
                    vals = vals * (median / norm)
                total.index_add_(0, idx, vals)
                count.index_add_(0, idx, torch.ones_like(vals))
        out[name] = torch.where(count > 0, total / count.clamp(min=1.0), total).reshape(shape)
    return out


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
    """θ ← θ − lr·Δ − lr·wd·θ in place (DESIGN §2.1: plain SGD outer step, α applied once).

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

    Checked before any parameter changes (all-or-nothing rounds, TRUST §2): Δ must be finite and
    max|θ|·|1 − lr·wd| + lr·max|Δ| must stay below float32's largest value, which bounds every result.
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
