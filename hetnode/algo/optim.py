"""Inner optimisers built from the `[inner]` config section."""

from __future__ import annotations

import torch
from torch import nn

from hetnode.config import InnerConfig


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


def build_optimizer(model: nn.Module, cfg: InnerConfig) -> torch.optim.Optimizer:
    if cfg.optimizer == "adamw":
        return torch.optim.AdamW(
            decay_groups(model, cfg.weight_decay), lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps
        )
    raise NotImplementedError(f"inner.optimizer = {cfg.optimizer!r} arrives with the pipeline optimisers")
