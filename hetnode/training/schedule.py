"""Learning-rate schedule: linear warmup, then cosine decay to a floor."""

from __future__ import annotations

import math


def warmup_cosine(step: int, base_lr: float, warmup: int, total: int, min_ratio: float) -> float:
    """LR for 0-based `step`: ramp to base_lr over `warmup` steps, then cosine to min_ratio*base_lr."""
    if step < warmup:
        return base_lr * (step + 1) / warmup
    if total <= warmup:
        return base_lr
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    floor = base_lr * min_ratio
    return floor + (base_lr - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))
