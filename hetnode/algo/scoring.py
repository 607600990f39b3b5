"""Scoring contributions (docs/security.md, "Send useless or harmful work"): is a decoded pseudo-gradient work
that helps? Pure math over tensors.

- `index_overlap`: the share of top-k positions two contributions have in common. Replicas training on
  different data select different coordinates; a copy of someone else's payload selects the same ones.
- `update_norm`: the L2 norm of a sparse update (free riders send almost nothing, scalers far too much).
- `loss_improvement`: how much applying one contribution alone, at a reduced step, lowers the loss on given
  batches: honest work lowers the loss on the batches it was trained on and on held-out text.
- `relative_scores`: improvements made comparable across rounds (the loss falls as training goes on): each
  divided by the round's median magnitude, minus a margin, so that work which helps far less than the
  typical contribution scores below zero.
- `stage_score`: a chain stage's score from its chain's, its part alone and what its part adds to the chain.
- `steps_shown`: paced rounds: how many inner steps an update's norm shows, against the round's others (a
  claim of steps is checked against it).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import torch
from torch import nn
from torch.func import functional_call

from hetnode.algo.quantiles import weighted_quantile

SparseValues = tuple[torch.Tensor, torch.Tensor]  # (flat indices, float32 values)
SCORE_MARGIN = 0.1  # a contribution must help at least this fraction of the round's typical one
# An update's norm grows as work^k, work the summed learning rate of its steps (`steps_shown`), k between
# 1/2 and 1. Where a round's others do not measure k, an update is judged at each of these and counted the
# most any shows: an honest replica far faster than all the others is not cut by a guessed k (a steady-state
# swarm's k ≈ 0.7 against a guess of 0.84 counted 20 honest steps as 13), and a claim no k in the range
# supports is still refused.
UNMEASURED_EXPONENTS = (0.5, 0.6, 0.7, 0.8, 0.9, 1.0)


def stage_score(chain: float, alone: float, marginal: float | None, scale: float) -> float:
    """A chain stage's score: `chain` its chain's relative score; `alone` and `marginal` improvements (as
    `loss_improvement`, over the round's `scale`) of its part applied alone and of the chain's update
    less what the rest of the chain does without it (None: not measured; only needed when `alone` < 0).

    A part that helps alone is never judged negative for a neighbour's (no framing). A part that hurts alone
    may still help its chain: a first stage's layers change what the later layers, trained on top of them,
    read, and alone they hurt (measured: an honest first stage's part alone scored below the margin from a
    dozen rounds in, its chain's whole update above it; it was left out, its payloads went back into error
    feedback, and later its chain's scores fell too). Such a part takes its chain's score; a part that hurts
    alone and makes its chain worse is judged by what it costs the chain."""
    if alone >= 0:
        return max(chain, 0.0)
    if marginal is not None and marginal >= 0:
        return chain
    cost = alone if marginal is None else marginal
    return min(chain, cost / scale - SCORE_MARGIN)


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


def steps_shown(
    updates: Mapping[str, Mapping[str, SparseValues]],
    claimed: Mapping[str, float],
    weights: Mapping[str, int],
) -> dict[str, float]:
    """The work each update's norm shows, in the unit of `claimed` (paced rounds, where each replica claims
    its own steps: the sealer counts them weighed by the learning rate they ran at).

    An update's norm grows as work^k with k between 1/2 and 1: ≈ 1 in a run's first steps (Adam's first
    steps agree), 0.84 a few rounds in, ≈ 0.6 in steady state, where error feedback carries earlier rounds'
    residue (measured: docs/sync.md, "Paced rounds"). So each update is judged against the others alone,
    never itself: from them, per tensor, k (the upper weighted median of log norm ratio / log work ratio
    over their pairs whose work differs by half or more; where none does, each k in UNMEASURED_EXPONENTS
    and the most any shows) and one unit's norm (the upper weighted median of norm / claimed^k: identities
    that claim more than they did sit below it); the update shows (norm / unit)^(1/k) units on each tensor,
    and the median over its tensors. Weighted: identities without
    a verified history (weight 0) move nothing; one identity cannot move its own judgement. An update with
    no other to be judged against shows what it claims."""
    per_tensor: dict[str, dict[str, float]] = {}
    for peer, update in updates.items():
        for name, values in update.items():
            if claimed.get(peer, 0) > 0:
                per_tensor.setdefault(name, {})[peer] = update_norm({name: values})
    held = {p: max(weights.get(p, 0), 0) for p in updates}
    if not any(held.values()):
        held = dict.fromkeys(updates, 1)  # only newcomers: all count alike
    shown: dict[str, list[float]] = {peer: [] for peer in updates}
    for norms in per_tensor.values():
        for peer, norm in norms.items():
            others = {p: n for p, n in norms.items() if p != peer and held[p] > 0}
            if not others or norm <= 0:
                continue
            measured = _exponent(others, claimed, held)
            ks = UNMEASURED_EXPONENTS if measured is None else (measured,)
            on_tensor = [w for k in ks if (w := _work_at(k, norm, others, claimed, held)) is not None]
            if on_tensor:
                shown[peer].append(max(on_tensor))
    return {peer: sorted(v)[len(v) // 2] if v else float(claimed.get(peer, 0)) for peer, v in shown.items()}


def _work_at(
    k: float, norm: float, others: Mapping[str, float], claimed: Mapping[str, float], held: Mapping[str, int]
) -> float | None:
    """The work a norm shows at exponent k, one unit's norm taken from the others (None: they show none)."""
    unit = weighted_quantile([(n / claimed[p] ** k, held[p]) for p, n in others.items()], 0.5, upper=True)
    return (norm / unit) ** (1 / k) if unit > 0 else None


def _exponent(
    norms: Mapping[str, float], claimed: Mapping[str, float], held: Mapping[str, int]
) -> float | None:
    """k in norm ∝ work^k from these updates' pairs whose work differs by half or more, within [1/2, 1]
    (None when no pair does)."""
    peers = sorted(p for p in norms if norms[p] > 0)
    slopes = [
        (math.log(norms[a] / norms[b]) / math.log(claimed[a] / claimed[b]), min(held[a], held[b]))
        for i, a in enumerate(peers)
        for b in peers[i + 1 :]
        if abs(math.log(claimed[a] / claimed[b])) >= math.log(1.5)
    ]
    if not slopes:
        return None
    # upper: an identity that claims more than it did flattens the pairs it is in
    return min(1.0, max(0.5, weighted_quantile(slopes, 0.5, upper=True)))
