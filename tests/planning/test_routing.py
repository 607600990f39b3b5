"""Routing a micro-batch to a worker of the next stage's pool, and what a sender learns of each worker."""

import math

import pytest

from hetnode.planning.routing import (
    AGREE_COS,
    AGREE_NORM_FACTOR,
    NORM_FACTOR,
    NORM_WARMUP,
    NormWatch,
    ServiceTime,
    WorkerLoad,
    gradients_agree,
    odd_one_out,
    pick_worker,
)


def test_every_worker_is_tried_each_round_before_the_fastest_is_preferred():
    fast = WorkerLoad("a", served=3, in_flight=0, per_mb_s=0.1)
    idle = WorkerLoad("b", served=0, in_flight=0, per_mb_s=9.0)
    assert pick_worker([fast, idle]) == "b"  # not tried this round: it goes first, however slow
    assert pick_worker([fast, WorkerLoad("b", 1, 0, 9.0)]) == "a"


def test_a_micro_batch_goes_where_it_is_expected_back_soonest():
    slow = WorkerLoad("slow", served=2, in_flight=0, per_mb_s=3.0)
    busy = WorkerLoad("busy", served=2, in_flight=1, per_mb_s=1.0)
    assert pick_worker([slow, busy]) == "busy"  # 2 × 1.0 < 1 × 3.0
    busier = WorkerLoad("busy", served=2, in_flight=3, per_mb_s=1.0)
    assert pick_worker([slow, busier]) == "slow"  # 4 × 1.0 > 3.0
    # not measured yet: counted as the fastest measured; ties to fewer in flight, then the name
    assert pick_worker([WorkerLoad("x", 1, 1, None), WorkerLoad("y", 1, 0, 2.0)]) == "y"
    assert pick_worker([WorkerLoad("b", 1, 0, 1.0), WorkerLoad("a", 1, 0, 1.0)]) == "a"
    with pytest.raises(ValueError):
        pick_worker([])


def test_a_workers_time_per_micro_batch_is_its_round_trip_over_its_queue():
    service = ServiceTime()
    service.observe(4.0, queue=2)
    assert service.per_mb_s == 2.0
    service.observe(1.0, queue=1)
    assert service.per_mb_s == pytest.approx(0.7 * 2.0 + 0.3 * 1.0)


def test_a_worker_that_turns_to_sending_frames_far_off_the_pools_is_caught_at_its_first():
    watch = NormWatch()
    for i in range(NORM_WARMUP):
        assert watch.judge("honest", 1.0 + 0.1 * (i % 3)) is None
        assert watch.judge("liar", 1.2) is None
    why = watch.judge("liar", 1.2 * NORM_FACTOR * 1.5)
    assert why is not None and "off its own" in why
    assert watch.judge("liar", 1.2 / NORM_FACTOR / 1.5) is not None
    # its lies were not learned from: it is still judged against its honest history, and so is the other
    assert watch.judge("liar", 1e6) is not None and math.isclose(math.exp(watch.typical["liar"]), 1.2)
    assert watch.judge("honest", 1.1) is None
    # within the factor is honest variation (gradients shrink as the loss falls)
    assert watch.judge("liar", 1.2 * NORM_FACTOR / 2) is None
    # alone (no other worker with history) nothing is judged
    assert NormWatch().judge("solo", 1e9) is None
    watch.forget("honest")
    assert watch.judge("liar", 1e9) is None


def test_a_jump_found_honest_is_learned_and_stops_being_judged_off():
    # an honest gradient far off (early in training), cleared by another worker's answer for the same input
    watch = NormWatch()
    for _ in range(NORM_WARMUP):
        assert watch.judge("a", 1.0) is None and watch.judge("b", 1.0) is None
    jumped = 50.0
    assert watch.judge("a", jumped) is not None  # not learned: judged off
    learned = 0
    while watch.judge("a", jumped) is not None:
        watch.learn("a", jumped)
        learned += 1
    assert 1 <= learned <= 3  # a few honest answers bring its history to the jump


def test_an_honest_worker_is_never_blamed_for_what_a_liar_taught_the_pool():
    # the liar lies from its first frame: the honest worker, steady against its own history, is not blamed
    watch = NormWatch()
    for _ in range(3 * NORM_WARMUP):
        assert watch.judge("liar", 1e3) is None  # steady against its own history: left to the verifier
        assert watch.judge("honest", 1.0) is None
    # and a worker new to the pool is not judged before its own history
    assert watch.judge("newcomer", 1e6) is None


def test_gradients_agree_when_they_point_alike_at_a_like_norm():
    assert gradients_agree(0.9, 1.2) and gradients_agree(0.02, 1.0)  # honest pairs from a fresh init
    assert not gradients_agree(-0.9, 1.0)  # one sign flipped
    assert gradients_agree(0.3, 47.2)  # the farthest apart of 287 honest pairs from a fresh init
    assert not gradients_agree(0.9, 1000.0)  # one scaled by the `grad-scaled` fault
    assert gradients_agree(AGREE_COS, AGREE_NORM_FACTOR) and not gradients_agree(AGREE_COS - 0.01, 1.0)
    assert not gradients_agree(0.9, AGREE_NORM_FACTOR * 1.01)


def test_of_three_workers_the_odd_one_out_is_the_one_against_both_others():
    a, b, c = "a", "b", "c"

    def verdicts(ab: bool, ac: bool, bc: bool) -> dict[frozenset[str], bool]:
        return {frozenset((a, b)): ab, frozenset((a, c)): ac, frozenset((b, c)): bc}

    assert odd_one_out(verdicts(True, False, False)) == c
    assert odd_one_out(verdicts(False, False, True)) == a
    assert odd_one_out(verdicts(True, True, True)) is None  # all agree
    assert odd_one_out(verdicts(False, False, False)) is None  # no majority
    assert odd_one_out(verdicts(True, True, False)) is None  # b and c disagree, both agree with a
    with pytest.raises(ValueError, match="three workers"):
        odd_one_out({frozenset((a, b)): False})
