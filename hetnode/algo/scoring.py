"""Scoring contributions (TRUST §4): is a decoded pseudo-gradient work that helps? Pure math over tensors.

- `index_overlap`: the share of top-k positions two contributions have in common. Replicas training on
  different data select different coordinates; a copy of someone else's payload selects the same ones.
- `update_norm`: the L2 norm of a sparse update (free riders send almost nothing, scalers far too much).
- `loss_improvement`: how much applying one contribution alone, at a reduced step, lowers the loss on given
  batches: honest work lowers the loss on the batches it was trained on and on held-out text.
- `relative_scores`: improvements made comparable across rounds (the loss falls as training goes on): each
  divided by the round's median magnitude, minus a margin, so that work which helps far less than the
  typical contribution scores below zero.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import torch
from torch import nn
from torch.func import functional_call

SparseValues = tuple[torch.Tensor, torch.Tensor]  # (flat indices, float32 values)
SCORE_MARGIN = 0.1  # a contribution must help at least this fraction of the round's typical one


def update_norm(update: Mapping[str, SparseValues]) -> float:
    return math.sqrt(sum(float(values.double().pow(2).sum()) for _, values in update.values()))


def index_overlap(a: Mapping[str, SparseValues], b: Mapping[str, SparseValues]) -> float:
    """|A ∩ B| / min(|A|, |B|) over (tensor, index) positions of the tensors both sent (0 when none)."""
    shared = sorted(set(a) & set(b))
    common = smaller = 0
    for name in shared:
        ia, ib = a[name][0].reshape(-1), b[name][0].reshape(-1)
        common += int(torch.isin(ia, ib).sum())
        smaller += min(ia.numel(), ib.numel())
    return common / smaller if smaller else 0.0


def dense_update(
    update: Mapping[str, SparseValues], shapes: Mapping[str, tuple[int, ...]]
) -> dict[str, torch.Tensor]:
    """The sparse update scattered into dense float32 tensors (only the tensors it sent)."""
    out = {}
    for name, (indices, values) in update.items():
        dense = torch.zeros(math.prod(shapes[name]), dtype=torch.float32)
        dense[indices.reshape(-1).long()] = values.reshape(-1).float()
        out[name] = dense.reshape(shapes[name])
    return out


@torch.no_grad()
def batch_loss(model: nn.Module, params: Mapping[str, torch.Tensor], batches: Sequence[tuple]) -> float:
    """Mean loss of `model` with `params` over (inputs, targets) batches."""
    model.eval()
    losses = [float(functional_call(model, dict(params), (x, y))) for x, y in batches]
    return sum(losses) / len(losses)


@torch.no_grad()
def loss_improvement(
    model: nn.Module,
    params: Mapping[str, torch.Tensor],
    delta: Mapping[str, torch.Tensor],
    step: float,
    batches: Sequence[tuple],
    before: float | None = None,
) -> float:
    """loss(θ) − loss(θ − step·Δ) on `batches` (positive: the update helps). `before`: loss(θ) if known."""
    after = {name: (p - step * delta[name]) if name in delta else p for name, p in params.items()}
    if before is None:
        before = batch_loss(model, params, batches)
    return before - batch_loss(model, after, batches)


def improvement_scale(improvements: Mapping[str, float]) -> float:
    """The round's yardstick: the upper median of the improvements' magnitudes. With two contributions the
    larger sets the scale (a free rider beside one honest replica must not be the yardstick); it is always
    an actual contribution's."""
    magnitudes = sorted(abs(v) for v in improvements.values())
    return max(magnitudes[len(magnitudes) // 2], 1e-12) if magnitudes else 1e-12


def relative_scores(
    improvements: Mapping[str, float], margin: float = SCORE_MARGIN, scale: float | None = None
) -> dict[str, float]:
    """Each improvement over `scale` (by default the round's `improvement_scale`), minus `margin`.

    Honest work scores about 1 − margin; a free rider about −margin; noise and sign flips below that."""
    if not improvements:
        return {}
    scale = improvement_scale(improvements) if scale is None else max(scale, 1e-12)
    return {key: value / scale - margin for key, value in improvements.items()}
