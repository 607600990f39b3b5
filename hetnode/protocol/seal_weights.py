"""What each sealed contribution counts for: its weight in the aggregate (earned by verified history, TRUST
§4) and, under paced rounds, the inner steps it is credited with, no more than its update shows
(docs/sync.md, "Paced rounds"); and what a paced round's budget learns from the sealed replicas."""

from __future__ import annotations

import bisect
import itertools
import logging
import math
from collections.abc import Collection, Iterable, Mapping
from typing import TYPE_CHECKING

from hetnode.algo.aggregation_rules import MAX_WEIGHT
from hetnode.algo.scoring import steps_shown
from hetnode.config import Config
from hetnode.training.schedule import schedule_position, warmup_cosine

if TYPE_CHECKING:
    from hetnode.protocol.payload_checks import Checked

log = logging.getLogger(__name__)

# a claim of steps counts up to this much over what its update's norm shows (honest norms at equal steps
# differ by ±2 %: benchmarks/results/paced_weighting)
STEPS_SLACK = 1.15


def paced_weights(
    config: Config, earned: dict[str, int], steps: dict[str, int], pooled: Collection[str] = ()
) -> dict[str, int]:
    """Each sealed contribution's weight in the aggregate: earned by verified history, and under paced
    rounds times its (verified) steps, measured better than 1/N at equal tokens
    (benchmarks/paced_weighting.py; docs/sync.md, "Paced rounds"). At most probation_rounds × the cap.

    `pooled`: sealed workers of a stage pool (`pool_workers`). A pool's workers each train their own copy
    of the slice on the micro-batches routed to it; weighed as one replica each, a pool of k would give
    its slice k times the weight of its chain's other slices. So a round with a pool worker sealed is
    weighed by steps even when not paced: everyone counts H steps but the pool's workers, who count their
    own, and a stage's workers together weigh as one lone stage."""
    if not config.outer.paced and not pooled:
        return dict(earned)
    H = config.outer.inner_steps
    counted = steps if config.outer.paced else {p: steps.get(p, H) if p in pooled else H for p in earned}
    weights = {peer: w * max(1, counted.get(peer, H)) for peer, w in earned.items()}
    if config.outer.paced:
        return weights  # the config keeps probation_rounds × the cap within MAX_WEIGHT
    # not paced: divided by their common factor (equal weights are 1 each, the unweighted rule), and where
    # probation_rounds × H is past the aggregate's bound, scaled down to it (each at least 1): a worker's
    # weight is then its share rounded down, the only approximation, and only past the bound
    common = math.gcd(*weights.values()) or 1
    weights = {peer: w // common for peer, w in weights.items()}
    top = max(weights.values(), default=0)
    if top > MAX_WEIGHT:
        weights = {peer: max(1, w * MAX_WEIGHT // top) for peer, w in weights.items()}
    return weights


def pool_workers(
    peers: Iterable[str], replica_of: Mapping[str, str], stage_of: Mapping[str, int | None]
) -> set[str]:
    """The peers among `peers` that share their chain's stage with another of them: a pool's workers."""
    holders: dict[tuple[str, int], list[str]] = {}
    for peer in peers:
        stage = stage_of.get(peer)
        if stage is not None and replica_of.get(peer, peer) != peer:
            holders.setdefault((replica_of[peer], stage), []).append(peer)
    return {peer for pool in holders.values() if len(pool) > 1 for peer in pool}


def round_lr(config: Config, round_: int) -> list[float]:
    """The learning rate of each inner step a replica may take in paced round `round_`, up to the cap
    (every replica's schedule, `schedule_position`)."""
    o, inner = config.outer, config.inner
    return [
        warmup_cosine(
            schedule_position(round_, i, o.inner_steps, o.step_cap),
            inner.lr,
            inner.warmup_steps,
            config.train.max_steps,
            inner.min_lr_ratio,
        )
        for i in range(o.step_cap)
    ]


def verified_steps(
    config: Config,
    round_: int,
    updates: Mapping[str, Mapping[str, tuple]],
    claimed: Mapping[str, int],
    weights: Mapping[str, int],
) -> dict[str, int]:
    """Paced round `round_`: the steps each update counts, min(claimed, the most whose summed learning rate
    is within STEPS_SLACK × what its norm shows), at least 1 (`steps_shown`; docs/sync.md)."""
    work = list(itertools.accumulate(round_lr(config, round_), initial=0.0))  # work[n]: lr of n steps
    shown = steps_shown(updates, {p: work[claimed[p]] for p in updates}, weights)
    return {
        p: max(1, min(claimed[p], bisect.bisect_right(work, shown[p] * STEPS_SLACK) - 1)) for p in updates
    }


def sealed_steps(
    config: Config,
    round_: int,
    good: list[Checked],
    claimed: dict[str, int],
    earned: dict[str, int],
    replica_of: Mapping[str, str],
    stage_of: Mapping[str, int | None] | None = None,
) -> dict[str, int]:
    """Paced rounds: each sealed contribution's steps. An anchor's, no more than its update's norm shows
    against the round's other anchors (`verified_steps`): a replica that claims more steps than it took
    gains neither weight nor credit by it. A chain stage's, its chain's count: a chain's stages train one
    count of micro-batches, which every later stage counts as they arrive (a stage's update, trained in a
    subspace by another optimiser, is no yardstick for an anchor's, nor the reverse). A stage held by a
    pool (`stage_of`: each chain member's stage; None or absent, a stage of its own) counts the
    micro-batches its workers claim between them; the chain's count is its fewest stage's, and a pool's
    worker is credited its own claim, never more than the chain's count."""
    chain_of = {a.peer_id: replica_of.get(a.peer_id, a.peer_id) for a, _, _ in good}
    anchors = [a for a in good if chain_of[a[0].peer_id] == a[0].peer_id]
    updates = {a.peer_id: {n: v for m in decoded for n, v in m.sparse.items()} for a, _, decoded in anchors}
    verified = verified_steps(config, round_, updates, claimed, earned)
    stage_sums: dict[str, dict[object, int]] = {}  # chain -> stage -> the steps its workers claim
    for peer, key in chain_of.items():
        if peer not in verified:
            stage = (stage_of or {}).get(peer)
            stage = peer if stage is None else stage
            sums = stage_sums.setdefault(key, {})
            sums[stage] = sums.get(stage, 0) + claimed[peer]
    count = {key: min(sums.values()) for key, sums in stage_sums.items()}
    verified |= {
        peer: min(claimed[peer], count[key]) for peer, key in chain_of.items() if peer not in verified
    }
    for peer in sorted(p for p in verified if verified[p] < claimed[p]):
        log.info("%s claims %d steps, its update shows %d", peer[-8:], claimed[peer], verified[peer])
    return verified


def per_replica(
    good: list[Checked],
    steps: dict[str, int],
    earned: dict[str, int],
    replica_of: Mapping[str, str],
    stage_of: Mapping[str, int | None] | None = None,
) -> list[tuple[float, int, int]]:
    """(seconds in inner steps, steps, weight) per replica for the round's budget: a chain once, at its
    slowest stage's time, its count (the fewest over its stages of the steps a stage's workers took
    between them: a pool's workers share its micro-batches, `stage_of`) and its lightest stage's weight
    (a pool's: its lightest worker's)."""
    by_replica: dict[str, dict[object, list[tuple[float, int, int]]]] = {}
    for a, _, _ in good:
        key = replica_of.get(a.peer_id, a.peer_id)
        stage = (stage_of or {}).get(a.peer_id)
        stage = a.peer_id if stage is None else stage
        part = (a.train_s, steps[a.peer_id], earned[a.peer_id])
        by_replica.setdefault(key, {}).setdefault(stage, []).append(part)
    out = []
    for stages in by_replica.values():
        parts = [part for pool in stages.values() for part in pool]
        count = min(sum(n for _, n, _ in pool) for pool in stages.values())
        out.append((max(t for t, _, _ in parts), count, min(w for _, _, w in parts)))
    return out
