"""Inner optimisers built from the `[inner]` config section (docs/chains.md, "Asynchronous 1F1B with weight
stashing").

* ``adamw``: the default.
* ``nadam``: Adam with Nesterov momentum and a high constant β1 (``nadam_beta1`` = 0.99), the strongest
  asynchronous-pipeline baseline in arXiv 2602.03515: the look-ahead partly compensates for the weight delay.
* ``rotated_adamw``: `RotatedAdamW` (basis rotation, arXiv 2602.03515) on the attention and MLP matrices,
  plain AdamW arithmetic on embeddings, norms and the head, all in one optimiser object; its bases are
  trimmed to ``rotation_budget`` of a step's FLOPs when the caller passes the tokens of a step.

Weight decay is decoupled everywhere and applies to matrices only.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn

from hetnode.algo.rotated_adam import RotatedAdamW, check_adam_hyperparameters
from hetnode.config import InnerConfig

OPTIMIZERS = ("adamw", "nadam", "rotated_adamw")
ROTATED_NAME_PARTS = (".attn.w", ".mlp.w")  # blocks.N.attn.wq.weight, blocks.N.mlp.w_gate.weight, ...


def decay_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """Weight decay on matrices only; norms and other 1-D parameters are not decayed (standard for LMs)."""
    decay, no_decay = [], []
    for param in model.parameters():
        if param.requires_grad:
            (decay if param.ndim >= 2 else no_decay).append(param)
    return [
        {"params": decay, "weight_decay": weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]


def is_rotated(name: str, param: torch.Tensor) -> bool:
    """Attention and MLP matrices get the rotated basis; embeddings, norms and the head stay in AdamW."""
    return param.ndim == 2 and any(part in name for part in ROTATED_NAME_PARTS)


def rotation_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """`RotatedAdamW` groups: rotated matrices, other matrices (AdamW), 1-D parameters (AdamW, no decay)."""
    rotated, plain, no_decay = [], [], []
    for name, param in model.named_parameters():
        if not param.requires_grad:
            continue
        if is_rotated(name, param):
            rotated.append(param)
        else:
            (plain if param.ndim >= 2 else no_decay).append(param)
    return [
        {"params": rotated, "weight_decay": weight_decay, "rotate": True},
        {"params": plain, "weight_decay": weight_decay, "rotate": False},
        {"params": no_decay, "weight_decay": 0.0, "rotate": False},
    ]


class NAdamW(torch.optim.Optimizer):
    """Adam with Nesterov momentum at a constant μ = β1 and decoupled weight decay (Dozat 2016).

    ``torch.optim.NAdam`` does not do this: its momentum schedule is μ_t = β1·(1 − ½·0.96^(t·ψ)), so
    ``momentum_decay=0`` gives a constant μ = β1/2, not β1. With m_t = β1 m + (1−β1) g and v as in Adam:

        θ ← θ(1 − lr·wd) − lr · [β1 m_t/(1−β1^(t+1)) + (1−β1) g/(1−β1^t)] / (√(v_t/(1−β2^t)) + ε)
    """

    def __init__(
        self,
        params: Iterable[torch.Tensor] | Iterable[dict[str, Any]],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.99, 0.95),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
    ) -> None:
        check_adam_hyperparameters(lr, betas, eps, weight_decay)
        super().__init__(params, {"lr": lr, "betas": tuple(betas), "eps": eps, "weight_decay": weight_decay})

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            lr, eps = group["lr"], group["eps"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                grad, state = p.grad, self.state[p]
                if not state:
                    state["step"] = 0
                    state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                    state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                state["step"] += 1
                t = state["step"]
                exp_avg, exp_avg_sq = state["exp_avg"], state["exp_avg_sq"]
                p.mul_(1.0 - lr * group["weight_decay"])
                exp_avg.lerp_(grad, 1.0 - beta1)
                exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1.0 - beta2)
                denom = (exp_avg_sq / (1.0 - beta2**t)).sqrt_().add_(eps)
                p.addcdiv_(grad, denom, value=-lr * (1.0 - beta1) / (1.0 - beta1**t))
                p.addcdiv_(exp_avg, denom, value=-lr * beta1 / (1.0 - beta1 ** (t + 1)))
        return loss


def build_optimizer(
    model: nn.Module, cfg: InnerConfig, name: str | None = None, tokens_per_step: int | None = None
) -> torch.optim.Optimizer:
    """The inner optimiser `name` (default: ``cfg.optimizer``) over all trainable parameters of `model`.

    `tokens_per_step` (batch × sequence of one optimiser step): with it, ``rotated_adamw`` fits each matrix's
    bases to ``cfg.rotation_budget`` of that step's FLOPs (`rotation_cost.plan_bases`); without it, the
    configured ``cfg.rotation`` for every matrix."""
    name = cfg.optimizer if name is None else name
    if name == "adamw":
        return torch.optim.AdamW(
            decay_groups(model, cfg.weight_decay), lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps
        )
    if name == "nadam":
        return NAdamW(
            decay_groups(model, cfg.weight_decay), lr=cfg.lr, betas=(cfg.nadam_beta1, cfg.beta2), eps=cfg.eps
        )
    if name == "rotated_adamw":
        return RotatedAdamW(
            rotation_groups(model, cfg.weight_decay),
            lr=cfg.lr,
            betas=(cfg.beta1, cfg.beta2),
            eps=cfg.eps,
            stat_decay=cfg.rotation_decay,
            refresh_every=cfg.rotation_refresh,
            one_sided=cfg.rotation == "one_sided",
            budget=cfg.rotation_budget,
            tokens_per_step=tokens_per_step,
        )
    raise ValueError(f"unknown inner optimizer {name!r}; choose one of {', '.join(OPTIMIZERS)}")
