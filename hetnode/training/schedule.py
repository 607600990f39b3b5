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


def schedule_position(round_: int, step: int, inner_steps: int, cap: int) -> int:
    """The learning-rate schedule's position of inner step `step` of round `round_`, the same for every
    replica whatever its pace: round t covers [t·H, (t+1)·H) whether it takes 1 step or the cap, so a
    fast replica does not run ahead of the swarm's schedule and a slow one does not fall behind it."""
    return round_ * inner_steps + min(step, cap - 1) * inner_steps // cap


def stage_window(stages: int, index: int, max_in_flight: int = 0) -> int:
    """Micro-batches stage `index` of `stages` keeps unanswered (forwarded, not yet back-propagated).

    0 gives the 1F1B schedule of the papers: P − s in flight, so stage s sees weights exactly τ_s = P−1−s
    updates old once the pipeline is full. A wider `max_in_flight` W hides more link latency at the price
    of W − P more updates of staleness on every stage (W − s in flight, never less than one)."""
    if not 0 <= index < stages:
        raise ValueError(f"stage {index} is not in a chain of {stages}")
    first = stages if max_in_flight <= 0 else max_in_flight
    return max(1, first - index)
