"""AdamW in a slowly refreshed eigenbasis of the gradient covariance (basis rotation, arXiv 2602.03515).

Asynchronous pipelines apply updates computed on stale weights; the paper shows that rotating each weight
matrix's coordinates into the eigenbasis of its gradient statistics makes Adam's diagonal preconditioner fit
the curvature much better, which is what makes the stale updates tolerable. For a weight G ∈ R^{m×n}:

    L ← d·L + (1−d)·G Gᵀ      R ← d·R + (1−d)·Gᵀ G          (d = stat_decay, e.g. 0.999)
    m ← β1 m + (1−β1) G                                      (first moment, original coordinates)
    G̃ = Q_Lᵀ G Q_R            v ← β2 v + (1−β2) G̃²           (second moment, rotated coordinates)
    θ ← θ − lr·wd·θ − lr · Q_L [ (Q_Lᵀ m Q_R)/(1−β1ᵗ) / (√(v/(1−β2ᵗ)) + ε) ] Q_Rᵀ

Choices made here (all of them documented because they change numbers):

* L and R are **not** bias-corrected: only their eigenvectors (and the order of their Rayleigh quotients) are
  used, and both are invariant to a positive scale.
* Bases are refreshed at steps 1, 1+k, 1+2k, ... (k = ``refresh_every``), after L and R took in that step's
  gradient. Step 1 uses ``torch.linalg.eigh`` (eigenvectors by descending eigenvalue), so there is no AdamW
  warm-up phase; later refreshes do one power-iteration step and a QR, ``Q ← qr(L·Q_old)``, then order the
  columns by the estimated eigenvalues ``diag(Qᵀ L Q)``, descending.
* When a basis changes, v is re-projected so it stays aligned with the new coordinates. With the overlaps
  ``P_L = Q_L,newᵀ Q_L,old`` and ``P_R = Q_R,newᵀ Q_R,old`` the rotated gradient moves as
  ``G̃_new = P_L G̃_old P_Rᵀ``; treating the entries of G̃_old as independent with variances v gives
  ``v_new = (P_L∘P_L) v (P_R∘P_R)ᵀ``. The squared overlaps are doubly stochastic, so the total second-moment
  mass is kept, and when the new basis is only a re-ordering (or sign flip) of the old one this is exactly the
  SOAP-style permutation of v.
* The one-sided variant rotates only the smaller side (the left one when m < n, else the right one, as the
  authors' code does) and keeps the identity on the other, cutting the extra memory from m² + n² to
  min(m, n)² (times two: statistic and basis).
* With ``tokens_per_step`` and ``budget`` set, each matrix takes the richest bases whose FLOPs stay within
  ``budget`` of its step (`rotation_cost.plan_bases`): two-sided, one-sided, or one-sided in block-diagonal
  bases (the statistics, bases and overlaps are then stacks of b×b blocks, shape (s/b, b, b)).
* Against the authors' code (github.com/joonkyoo/basis-rotation, ``optim/basis_rotation.py``): the same
  order within a step, statistics taken in every step, refreshes one step later (1, 1+k, ... here; 1, k,
  2k, ... there). Their ε is added to the un-corrected √v with the step scaled by √(1−β2ᵗ)/(1−β1ᵗ), i.e. an
  ε larger by 1/√(1−β2ᵗ) in the first ~1/(1−β2) steps; ours keeps a frozen basis exactly AdamW in rotated
  coordinates. Their refresh sorts the old basis and permutes v before the QR and does not re-project v.
* Parameters that are not matrices, and every parameter of a group with ``rotate=False``, get plain AdamW
  (the identical update to ``torch.optim.AdamW`` with decoupled decay). ``identity_bases=True`` sets the
  default ``rotate=False``; tests use it to check the AdamW equivalence.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch

from hetnode.algo.rotation_cost import Bases, full_bases, plan_bases


def check_adam_hyperparameters(
    lr: float, betas: tuple[float, float], eps: float, weight_decay: float
) -> None:
    """Shared constructor checks of the Adam-family optimisers here."""
    if lr < 0 or eps < 0 or weight_decay < 0:
        raise ValueError(f"lr, eps and weight_decay must be >= 0, got {lr}, {eps}, {weight_decay}")
    if not all(0.0 <= b < 1.0 for b in betas):
        raise ValueError(f"betas {betas} must lie in [0, 1)")


class RotatedAdamW(torch.optim.Optimizer):
    """AdamW whose second moment lives in the eigenbasis of E[GGᵀ] / E[GᵀG] (arXiv 2602.03515).

    Group options: ``lr``, ``betas``, ``eps``, ``weight_decay``, ``stat_decay``, ``refresh_every``,
    ``one_sided``, ``rotate`` (False: plain AdamW for that group, e.g. embeddings, norms and the head),
    and ``budget`` with ``tokens_per_step`` (both set: each matrix's bases by `plan_bases`).
    """

    def __init__(
        self,
        params: Iterable[torch.Tensor] | Iterable[dict[str, Any]],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.95),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        stat_decay: float = 0.999,
        refresh_every: int = 10,
        one_sided: bool = False,
        identity_bases: bool = False,
        budget: float | None = None,
        tokens_per_step: int | None = None,
    ) -> None:
        check_adam_hyperparameters(lr, betas, eps, weight_decay)
        if not 0.0 <= stat_decay < 1.0:
            raise ValueError(f"stat_decay {stat_decay} must lie in [0, 1)")
        if refresh_every < 1:
            raise ValueError(f"refresh_every must be >= 1, got {refresh_every}")
        if (budget is not None and budget <= 0) or (tokens_per_step is not None and tokens_per_step < 1):
            raise ValueError(f"budget must be > 0 and tokens_per_step >= 1, got {budget}, {tokens_per_step}")
        defaults = {
            "lr": lr,
            "betas": tuple(betas),
            "eps": eps,
            "weight_decay": weight_decay,
            "stat_decay": stat_decay,
            "refresh_every": refresh_every,
            "one_sided": one_sided,
            "rotate": not identity_bases,
            "budget": budget,
            "tokens_per_step": tokens_per_step,
        }
        super().__init__(params, defaults)

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            plain = []
            for p in group["params"]:
                if p.grad is None:
                    continue
                if p.grad.is_sparse:
                    raise RuntimeError("RotatedAdamW does not support sparse gradients")
                state = self.state[p]
                if not state:
                    _init_state(state, p, group)
                state["step"] += 1
                if "Q_L" in state or "Q_R" in state:
                    _rotated_step(p, state, group)
                else:
                    plain.append(p)
            self._adamw_step(plain, group)
        return loss

    def _adamw_step(self, params: list[torch.Tensor], group: dict[str, Any]) -> None:
        """The exact torch.optim.AdamW arithmetic, each stage of it one list operation over the parameters."""
        by_step: dict[int, list[torch.Tensor]] = {}
        for p in params:  # the bias corrections differ if some parameter missed a step
            by_step.setdefault(self.state[p]["step"], []).append(p)
        beta1, beta2 = group["betas"]
        lr, eps = group["lr"], group["eps"]
        for t, ps in by_step.items():
            states = [self.state[p] for p in ps]
            grads = [p.grad for p in ps]
            exp_avgs, exp_avg_sqs = [s["exp_avg"] for s in states], [s["exp_avg_sq"] for s in states]
            torch._foreach_mul_(ps, 1.0 - lr * group["weight_decay"])
            torch._foreach_lerp_(exp_avgs, grads, 1.0 - beta1)
            torch._foreach_mul_(exp_avg_sqs, beta2)
            torch._foreach_addcmul_(exp_avg_sqs, grads, grads, value=1.0 - beta2)
            denom = torch._foreach_sqrt(exp_avg_sqs)
            torch._foreach_div_(denom, (1.0 - beta2**t) ** 0.5)
            torch._foreach_add_(denom, eps)
            torch._foreach_addcdiv_(ps, exp_avgs, denom, value=-lr / (1.0 - beta1**t))


def _rotated_step(p: torch.Tensor, state: dict[str, Any], group: dict[str, Any]) -> None:
    """One update of a rotated matrix, the same arithmetic as the formula in the module docstring done with as
    few passes and temporaries as it allows: G̃'s buffer takes the denominator once v has taken G̃², and the
    last product goes straight into p together with the weight decay (`add_from_basis`)."""
    t = state["step"]
    beta1, beta2 = group["betas"]
    lr, eps = group["lr"], group["eps"]
    grad = p.grad.float()
    _update_statistics(state, grad, group["stat_decay"])
    if (t - 1) % group["refresh_every"] == 0:
        _refresh_bases(state, first=t == 1)
    q_left, q_right = state.get("Q_L"), state.get("Q_R")
    exp_avg, exp_avg_sq = state["exp_avg"], state["exp_avg_sq"]
    grad_rot = to_basis(grad, q_left, q_right)
    exp_avg_sq.mul_(beta2).addcmul_(grad_rot, grad_rot, value=1.0 - beta2)
    exp_avg.lerp_(p.grad, 1.0 - beta1)
    step_rot = to_basis(exp_avg.float(), q_left, q_right)
    denom = torch.sqrt(exp_avg_sq, out=grad_rot).div_((1.0 - beta2**t) ** 0.5).add_(eps)  # G̃ is spent
    step_rot.div_(denom)
    decay, alpha = 1.0 - lr * group["weight_decay"], -lr / (1.0 - beta1**t)
    add_from_basis(p, step_rot, q_left, q_right, decay, alpha)


def to_basis(x: torch.Tensor, q_left: torch.Tensor | None, q_right: torch.Tensor | None) -> torch.Tensor:
    """Q_Lᵀ x Q_R, with None standing for the identity (the unrotated side of the one-sided variant)."""
    if q_left is not None:
        x = left_apply(q_left.mT, x)
    if q_right is not None:
        x = right_apply(x, q_right)
    return x


def from_basis(x: torch.Tensor, q_left: torch.Tensor | None, q_right: torch.Tensor | None) -> torch.Tensor:
    """Q_L x Q_Rᵀ: the inverse of `to_basis` (both bases are orthogonal)."""
    if q_left is not None:
        x = left_apply(q_left, x)
    if q_right is not None:
        x = right_apply(x, q_right.mT)
    return x


def add_from_basis(
    p: torch.Tensor,
    x: torch.Tensor,
    q_left: torch.Tensor | None,
    q_right: torch.Tensor | None,
    decay: float,
    alpha: float,
) -> None:
    """p ← decay·p + alpha·Q_L x Q_Rᵀ, the last product accumulated straight into p (weight decay and update
    in one pass, no temporary)."""
    if p.dtype != x.dtype:  # a low-precision parameter: the products stay in float32
        p.mul_(decay).add_(from_basis(x, q_left, q_right).to(p.dtype), alpha=alpha)
        return
    if q_right is not None:
        if q_left is not None:
            x = left_apply(q_left, x)
        cols = column_blocks(p, q_right)
        cols.baddbmm_(column_blocks(x, q_right), as_stack(q_right).mT, beta=decay, alpha=alpha)
    elif q_left is not None:
        row_blocks(p, q_left).baddbmm_(as_stack(q_left), row_blocks(x, q_left), beta=decay, alpha=alpha)
    else:
        raise ValueError("add_from_basis needs a basis on at least one side")


def as_stack(mats: torch.Tensor) -> torch.Tensor:
    """A basis as a (s/b, b, b) stack: a full s×s basis is a stack of one."""
    return mats if mats.ndim == 3 else mats.unsqueeze(0)


def row_blocks(x: torch.Tensor, mats: torch.Tensor) -> torch.Tensor:
    """x's rows in the blocks of `mats`: a (s/b, b, n) view (splitting a dimension never copies)."""
    return x.unflatten(0, (-1, mats.shape[-1]))


def column_blocks(x: torch.Tensor, mats: torch.Tensor) -> torch.Tensor:
    """x's columns in the blocks of `mats`: a (s/b, m, b) view."""
    return x.unflatten(1, (-1, mats.shape[-1])).transpose(0, 1)


def left_apply(mats: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """M x, where M is one s×s matrix or the block diagonal of a (s/b, b, b) stack."""
    if mats.ndim == 2:
        return mats @ x
    return (mats @ row_blocks(x, mats)).reshape(x.shape)


def right_apply(x: torch.Tensor, mats: torch.Tensor) -> torch.Tensor:
    """x M, where M is one s×s matrix or the block diagonal of a (s/b, b, b) stack."""
    if mats.ndim == 2:
        return x @ mats
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    torch.bmm(
        column_blocks(x, mats), mats, out=column_blocks(out, mats)
    )  # bmm fills out's column blocks itself
    return out


def bases_for(shape: torch.Size | tuple[int, ...], group: dict[str, Any]) -> Bases:
    """The block sizes of a parameter's bases: none for non-matrices and unrotated groups, else the
    configured sides, or `plan_bases` when the group has a budget and the tokens of a step."""
    if len(shape) != 2 or not group["rotate"]:
        return Bases(0, 0)
    m, n = shape
    budget, tokens = group.get("budget"), group.get("tokens_per_step")
    if budget is None or tokens is None:
        return full_bases(m, n, group["one_sided"])
    return plan_bases(m, n, tokens, budget, group["refresh_every"], group["one_sided"])


def _init_state(state: dict[str, Any], p: torch.Tensor, group: dict[str, Any]) -> None:
    state["step"] = 0
    state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
    bases = bases_for(p.shape, group)
    # v is kept in float32 when rotated: it is filled from float32 rotations, not from the raw gradient.
    sq_dtype = torch.float32 if bases.rotated else p.dtype
    state["exp_avg_sq"] = torch.zeros(p.shape, dtype=sq_dtype, device=p.device)
    sides = (("L", bases.left, p.shape[0]), ("R", bases.right, p.shape[1])) if bases.rotated else ()
    for side, block, size in sides:
        if block:  # a full basis is one s×s matrix; a blocked one a (s/b, b, b) stack
            shape = (size, size) if block == size else (size // block, block, block)
            state[f"stat_{side}"] = torch.zeros(shape, dtype=torch.float32, device=p.device)
            eye = torch.eye(block, dtype=torch.float32, device=p.device)
            state[f"Q_{side}"] = eye.expand(shape).contiguous()


def _update_statistics(state: dict[str, Any], grad: torch.Tensor, decay: float) -> None:
    """L ← d·L + (1−d)·G Gᵀ and R ← d·R + (1−d)·Gᵀ G (their diagonal blocks when blocked), in place."""
    for side in ("L", "R"):
        key = f"stat_{side}"
        if key not in state:
            continue
        if state[key].dtype != torch.float32:  # load_state_dict casts state to the parameter's dtype
            state[key] = state[key].float()
            state[f"Q_{side}"] = state[f"Q_{side}"].float()
        stat = state[key]
        if side == "L":
            rows = row_blocks(grad, stat)
            outer = rows @ rows.mT
        else:
            cols = column_blocks(grad, stat)
            outer = cols.mT @ cols
        stat.mul_(decay).add_(outer.reshape(stat.shape), alpha=1.0 - decay)
    if state["exp_avg_sq"].dtype != torch.float32:
        state["exp_avg_sq"] = state["exp_avg_sq"].float()


def _refresh_bases(state: dict[str, Any], first: bool) -> None:
    """New Q_L / Q_R from the statistics, and v re-projected onto them (see the module docstring)."""
    old: dict[str, torch.Tensor | None] = {"L": None, "R": None}
    new: dict[str, torch.Tensor | None] = {"L": None, "R": None}
    for side in ("L", "R"):
        key = f"stat_{side}"
        if key not in state:
            continue
        basis = eigenbasis(state[key]) if first else power_qr_step(state[key], state[f"Q_{side}"])
        if basis is not None:  # None: the solver failed (e.g. non-finite statistics), keep the old basis
            old[side], new[side] = state[f"Q_{side}"], basis
            state[f"Q_{side}"] = basis
    state["exp_avg_sq"] = reproject_second_moment(state["exp_avg_sq"], old["L"], new["L"], old["R"], new["R"])


def reproject_second_moment(
    v: torch.Tensor,
    left_old: torch.Tensor | None,
    left_new: torch.Tensor | None,
    right_old: torch.Tensor | None = None,
    right_new: torch.Tensor | None = None,
) -> torch.Tensor:
    """v in the new basis: (P_L∘P_L) v (P_R∘P_R)ᵀ with P = Q_newᵀ Q_old; a side whose bases are None is kept.

    Exact for a basis that is a permutation (with sign flips) of the old one; keeps the total of v otherwise.
    Blocked bases, (s/b, b, b) stacks, move v block by block.
    """
    if left_old is not None and left_new is not None:
        v = left_apply((left_new.mT @ left_old).square_(), v)
    if right_old is not None and right_new is not None:
        v = right_apply(v, (right_new.mT @ right_old).square_().mT)
    return v.clamp(min=0.0)


def eigenbasis(stat: torch.Tensor) -> torch.Tensor | None:
    """Eigenvectors of a symmetric PSD matrix (or of each in a stack) as columns, by descending eigenvalue;
    None if eigh fails."""
    try:
        _, vectors = torch.linalg.eigh(stat)
    except torch.linalg.LinAlgError:
        return None
    return vectors.flip(-1).contiguous()


def power_qr_step(stat: torch.Tensor, old: torch.Tensor) -> torch.Tensor | None:
    """One power-iteration step Q ← qr(stat·Q_old), columns re-sorted by diag(Qᵀ stat Q) descending
    (per block for a stack)."""
    if not torch.isfinite(stat).all():
        return None
    q, _ = torch.linalg.qr(stat @ old)
    estimated = (q * (stat @ q)).sum(dim=-2)
    order = torch.argsort(estimated, dim=-1, descending=True)
    return torch.gather(q, -1, order.unsqueeze(-2).expand_as(q)).contiguous()
