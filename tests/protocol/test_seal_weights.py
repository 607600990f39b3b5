"""What a sealed contribution counts for when a chain's stage is held by a pool of workers (each trains its
own copy of the slice on the micro-batches routed to it): the stage counts the micro-batches its workers
served between them, the chain its fewest stage's, and the pool's workers together weigh as one lone stage,
paced or not. Chains without a pool count as before."""

from __future__ import annotations

import pytest

from hetnode.algo.aggregation_rules import MAX_WEIGHT
from hetnode.config import replace
from hetnode.planning.rounds import Announcement
from hetnode.protocol.seal_weights import paced_weights, per_replica, pool_workers, sealed_steps

CHAIN = "c1-0"


@pytest.fixture
def paced(tiny_config):
    return replace(tiny_config, "outer", schedule="paced")  # H = 30, cap 60


def _good(claimed: dict[str, int], seconds: dict[str, float] | None = None):
    seconds = seconds or {}
    return [
        (Announcement(p, 0, {}, 0, 0.0, steps=n, train_s=seconds.get(p, 1.0)), {}, [])
        for p, n in claimed.items()
    ]


def _chain(stages: dict[str, int]) -> tuple[dict[str, str], dict[str, int]]:
    return dict.fromkeys(stages, CHAIN), dict(stages)


def test_pool_workers_share_a_chains_stage():
    replica_of, stage_of = _chain({"a": 0, "b": 0, "s": 1})
    replica_of |= {"c2-a": "c2-0", "c2-b": "c2-0"}
    stage_of |= {"c2-a": 0, "c2-b": 1, "anchor": 0}
    assert pool_workers(["a", "b", "s", "c2-a", "c2-b", "anchor"], replica_of, stage_of) == {"a", "b"}
    assert pool_workers(["a", "s"], replica_of, stage_of) == set()  # its pool-mate not sealed: alone
    assert pool_workers(["a", "b"], replica_of, {}) == set()  # no stage known: one worker a stage


def test_a_pools_stage_counts_its_workers_steps_summed(paced):
    replica_of, stage_of = _chain({"a": 0, "b": 0, "s": 1})
    claimed = {"a": 10, "b": 25, "s": 30, "anchor": 20}
    good = _good(claimed)
    earned = dict.fromkeys(claimed, 1)
    steps = sealed_steps(paced, 0, good, claimed, earned, replica_of, stage_of)
    # stage 0 served 35, stage 1 30: the chain's count is 30; each worker keeps its own claim
    assert steps == {"a": 10, "b": 25, "s": 30, "anchor": 20}
    # the pool served fewer than its neighbour: the chain counts the pool's
    short = claimed | {"b": 12}
    assert sealed_steps(paced, 0, good, short, earned, replica_of, stage_of)["s"] == 22
    # a worker never counts more than its chain: both claim the whole round
    greedy = claimed | {"a": 30, "b": 30}
    assert sealed_steps(paced, 0, good, greedy, earned, replica_of, stage_of) | {"anchor": 0} == {
        "a": 30,
        "b": 30,
        "s": 30,
        "anchor": 0,
    }
    # without stages (one worker a stage), the chain's fewest claim, as before pools
    assert sealed_steps(paced, 0, good, claimed, earned, replica_of) == {
        "a": 10,
        "b": 10,
        "s": 10,
        "anchor": 20,
    }


def test_a_chain_is_one_replica_in_the_budget_with_its_pools_steps_summed():
    replica_of, stage_of = _chain({"a": 0, "b": 0, "s": 1})
    steps = {"a": 10, "b": 20, "s": 30, "anchor": 20}
    good = _good(steps, {"a": 5.0, "b": 7.0, "s": 6.0, "anchor": 3.0})
    earned = {"a": 4, "b": 8, "s": 8, "anchor": 8}
    assert sorted(per_replica(good, steps, earned, replica_of, stage_of)) == [(3.0, 20, 8), (7.0, 30, 4)]
    assert sorted(per_replica(good, steps, earned, replica_of)) == [(3.0, 20, 8), (7.0, 10, 4)]  # as before


def test_a_pool_weighs_as_one_lone_stage_paced_or_not(tiny_config, paced):
    replica_of, stage_of = _chain({"a": 0, "b": 0, "s": 1})
    earned = {"a": 8, "b": 8, "s": 8, "anchor": 8}
    steps = {"a": 10, "b": 20, "s": 30, "anchor": 30}
    pooled = pool_workers(earned, replica_of, stage_of)
    # not paced, no pool: the earned weights themselves (equal ones: the unweighted rule)
    assert paced_weights(tiny_config, earned, steps) == earned
    # not paced, a pool sealed: by steps, everyone H but the pool's workers; over the common factor
    weights = paced_weights(tiny_config, earned, steps, pooled)
    assert weights == {"a": 1, "b": 2, "s": 3, "anchor": 3}
    assert weights["a"] + weights["b"] == weights["s"]  # the pool's slice weighs as the chain's others
    # not paced, a pool that served fewer than H between them: everyone else still counts H
    assert paced_weights(tiny_config, earned, steps | {"b": 5}, pooled) == {
        "a": 2,
        "b": 1,
        "s": 6,
        "anchor": 6,
    }
    # paced: earned × steps, the pool's own steps (sealed: never past the chain's count)
    weights = paced_weights(paced, earned, steps, pooled)
    assert weights["a"] + weights["b"] == weights["s"] == 240


def test_pool_weights_stay_within_the_aggregates_bound(tiny_config):
    """probation_rounds up to 1024 × H is past MAX_WEIGHT: the weights are scaled down to it, each ≥ 1."""
    replica_of, stage_of = _chain({"a": 0, "b": 0, "s": 1})
    earned = {"a": 1000, "b": 999, "s": 1000, "anchor": 7}
    steps = {"a": 1, "b": 29, "s": 30, "anchor": 30}
    weights = paced_weights(tiny_config, earned, steps, pool_workers(earned, replica_of, stage_of))
    assert max(weights.values()) == MAX_WEIGHT and min(weights.values()) >= 1
    assert all(isinstance(w, int) for w in weights.values())
    assert weights["s"] == MAX_WEIGHT and weights["b"] == 999 * 29 * MAX_WEIGHT // (1000 * 30)
