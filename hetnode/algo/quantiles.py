"""Weighted quantiles of plain numbers (no torch): the robust statistics paced rounds decide by, where an
identity counts by the weight it earned and strangers (weight 0) count for nothing."""

from __future__ import annotations

from collections.abc import Sequence


def weighted_quantile(samples: Sequence[tuple[float, int]], q: float, upper: bool = False) -> float:
    """The lower weighted `q`-quantile of (value, weight) samples, or the upper one (`upper`: counted from
    the largest value down): always an actual sample's value. Samples must not be empty."""
    ordered = sorted(samples, reverse=upper)
    total, counted = sum(w for _, w in ordered), 0
    for value, weight in ordered:
        counted += weight
        if counted >= q * total:
            return value
    return ordered[-1][0]
