"""What each sealed contribution counts for: its weight in the aggregate (earned by verified history, TRUST
§4) and, under paced rounds, the inner steps it is credited with, no more than its update shows
(docs/sync.md, "Paced rounds"); and what a paced round's budget learns from the sealed replicas."""

from __future__ import annotations

import bisect
import itertools
import logging
from collections.abc import Mapping
from typing import TYPE_CHECKING

from hetnode.algo.scoring import steps_shown
from hetnode.config import Config
from hetnode.training.schedule import schedule_position, warmup_cosine

if TYPE_CHECKING:
    from hetnode.protocol.payload_checks import Checked

log = logging.getLogger(__name__)

# a claim of steps counts up to this much over what its update's norm shows (honest norms at equal steps
# differ by ±2 %: benchmarks/results/paced_weighting)
STEPS_SLACK = 1.15


def paced_weights(config: Config, earned: dict[str, int], steps: dict[str, int]) -> dict[str, int]:
    """Each sealed contribution's weight in the aggregate: earned by verified history, and under paced
    rounds times its (verified) steps, measured better than 1/N at equal tokens
    (benchmarks/paced_weighting.py; docs/sync.md, "Paced rounds"). At most probation_rounds × the cap."""
    if not config.outer.paced:
        return dict(earned)
    return {peer: w * max(1, steps.get(peer, config.outer.inner_steps)) for peer, w in earned.items()}


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
) -> dict[str, int]:
    """Paced rounds: each sealed contribution's steps. An anchor's, no more than its update's norm shows
    against the round's other anchors (`verified_steps`): a replica that claims more steps than it took
    gains neither weight nor credit by it. A chain stage's, its chain's fewest: a chain's stages train one
    count of micro-batches, which every later stage counts as they arrive (a stage's update, trained in a
    subspace by another optimiser, is no yardstick for an anchor's, nor the reverse)."""
    chain_of = {a.peer_id: replica_of.get(a.peer_id, a.peer_id) for a, _, _ in good}
    anchors = [a for a in good if chain_of[a[0].peer_id] == a[0].peer_id]
    updates = {a.peer_id: {n: v for m in decoded for n, v in m.sparse.items()} for a, _, decoded in anchors}
    verified = verified_steps(config, round_, updates, claimed, earned)
    fewest: dict[str, int] = {}
    for peer, key in chain_of.items():
        if peer not in verified:
            fewest[key] = min(fewest.get(key, claimed[peer]), claimed[peer])
    verified |= {peer: fewest[key] for peer, key in chain_of.items() if peer not in verified}
    for peer in sorted(p for p in verified if verified[p] < claimed[p]):
        log.info("%s claims %d steps, its update shows %d", peer[-8:], claimed[peer], verified[peer])
    return verified


def per_replica(
    good: list[Checked], steps: dict[str, int], earned: dict[str, int], replica_of: Mapping[str, str]
) -> list[tuple[float, int, int]]:
    """(seconds in inner steps, steps, weight) per replica for the round's budget: a chain once, at its
    slowest stage's time, its fewest steps and its lightest stage's weight."""
    by_replica: dict[str, list[tuple[float, int, int]]] = {}
    for a, _, _ in good:
        key = replica_of.get(a.peer_id, a.peer_id)
        by_replica.setdefault(key, []).append((a.train_s, steps[a.peer_id], earned[a.peer_id]))
    return [
        (max(t for t, _, _ in parts), min(n for _, n, _ in parts), min(w for _, _, w in parts))
        for parts in by_replica.values()
    ]
