"""Balance contiguous layer ranges over pipeline stages by each stage's compute capacity."""

from __future__ import annotations

from collections.abc import Sequence


def split_layers(n_layers: int, capacities: Sequence[float]) -> list[range]:
    """Contiguous ranges covering 0..n_layers-1, sized in proportion to `capacities`.

    Sizes are the largest-remainder rounding of each stage's proportional share, raised to at least
    one layer (a stage without layers would still cost a network hop). Ties go to the earlier stage,
    so the same inputs always give the same split on every peer.
    """
    stages = len(capacities)
    if stages == 0:
        raise ValueError("need at least one stage")
    if n_layers < stages:
        raise ValueError(f"cannot split {n_layers} layers over {stages} stages (each needs one)")
    if any(not (c > 0) or c == float("inf") for c in capacities):
        raise ValueError(f"capacities must be finite and > 0, got {list(capacities)}")
    total = float(sum(capacities))
    shares = [n_layers * c / total for c in capacities]
    sizes = [max(1, int(s)) for s in shares]
    while sum(sizes) < n_layers:  # give a layer to the stage furthest below its share
        i = max(range(stages), key=lambda j: (shares[j] - sizes[j], -j))
        sizes[i] += 1
    while sum(sizes) > n_layers:  # take one from the stage furthest above its share
        i = max((j for j in range(stages) if sizes[j] > 1), key=lambda j: (sizes[j] - shares[j], -j))
        sizes[i] -= 1
    ranges, start = [], 0
    for size in sizes:
        ranges.append(range(start, start + size))
        start += size
    return ranges
