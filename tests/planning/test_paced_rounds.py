"""Paced rounds (`outer.schedule = "paced"`), the pure parts: a round's batches whatever its steps, the
budget learned from the swarm, when a replica takes another step or sits out, and the schedule's position."""

import pytest

from hetnode.config import load_config, replace
from hetnode.errors import ConfigError
from hetnode.planning.rounds import (
    BUSY_SHARE,
    PACED_WAIT_BUDGETS,
    SIT_OUT_SLACK,
    RoundBudget,
    another_step,
    assigned_batches,
    busy_floor,
    floor_seconds,
    paced_deadline,
    round_budget_left,
    sits_out,
)
from hetnode.training.schedule import schedule_position


def test_rounds_of_any_steps_never_share_a_batch_and_a_claim_names_exactly_its_batches():
    cap = 12
    seen: set[int] = set()
    for round_, steps in enumerate([1, 12, 3, 7, 12, 5]):
        batches = assigned_batches("peer-a", round_, steps, cap)
        assert len(batches) == steps and not seen & set(batches)
        seen |= set(batches)
        # the first k of a longer claim are the batches of a claim of k: steps name a prefix
        assert list(assigned_batches("peer-a", round_, cap, cap))[:steps] == list(batches)
    with pytest.raises(ValueError):
        assigned_batches("peer-a", 0, cap + 1, cap)
    # without a stride (the "steps" schedule) the batches are the ones of before
    assert assigned_batches("peer-a", 3, 10) == assigned_batches("peer-a", 3, 10, 10)


def test_the_budget_is_the_weighted_median_time_for_h_steps_and_strangers_cannot_move_it():
    budget = RoundBudget(inner_steps=10, floor_s=1.0, ceiling_s=100.0)
    assert budget.seconds is None  # no round with timings yet: replicas train H steps
    # (seconds, steps, weight): 5 s for 10 steps, 2 s for 5 steps (4 s for H), 40 s for 10 steps
    budget.observe([(5.0, 10, 4), (2.0, 5, 4), (40.0, 10, 1)])
    assert budget.seconds == 5.0
    # a crowd of weightless identities claiming an hour each, and nonsense, change nothing
    budget.observe([(3600.0, 1, 0)] * 50 + [(float("nan"), 10, 8), (-1.0, 10, 8), (9.0, 0, 8)])
    assert budget.seconds == 5.0
    for _ in range(budget.keep):  # only the last rounds count, within the floor and the ceiling
        budget.observe([(500.0, 10, 8)])
    assert budget.seconds == 100.0
    budget.observe([(0.01, 10, 8)] * 3)
    assert budget.seconds == 1.0


def test_a_lower_quantile_sizes_the_round_for_the_fastest_and_weightless_speed_moves_it_neither():
    timings = [(2.0, 10, 4), (4.0, 10, 4), (4.0, 10, 4), (16.0, 10, 4)]  # seconds for H: 2, 4, 4, 16
    typical = RoundBudget(inner_steps=10, floor_s=1.0, ceiling_s=100.0)
    fastest = RoundBudget(inner_steps=10, floor_s=1.0, ceiling_s=100.0, quantile=0.25)
    for budget in (typical, fastest):
        budget.observe(timings)
    assert (typical.seconds, fastest.seconds) == (4.0, 2.0)  # H for the median replica; H for the fastest
    # identities that earned nothing claiming to be a hundred times faster do not shorten the round
    fastest.observe(timings + [(0.02, 10, 0)] * 50)
    assert fastest.seconds == 2.0
    # a replica sitting out still raises it to its floor, and never past what the fastest needs for the cap
    assert fastest.seconds_for([3.0]) == 3.0 and fastest.seconds_for([60.0]) == 4.0


def test_where_most_replicas_are_slow_the_fast_ones_still_fit_their_cap():
    budget = RoundBudget(inner_steps=10, floor_s=1.0, ceiling_s=100.0, cap_ratio=2.0)
    # one fast replica (4 s for H) that has earned more, two slow ones (20 s for H): the median is slow,
    # but the fast one would reach its cap of 2H in 8 s and then wait: the budget is 8 s
    budget.observe([(4.0, 10, 8), (20.0, 10, 5), (20.0, 10, 5)])
    assert budget.seconds == 8.0


def test_a_replica_sitting_out_raises_the_budget_to_its_floor_never_past_the_fastest_cap():
    budget = RoundBudget(inner_steps=10, floor_s=1.0, ceiling_s=100.0, cap_ratio=2.0)
    budget.observe([(4.0, 10, 8), (4.0, 10, 8)])  # two replicas, 4 s for H: the median
    assert budget.seconds_for([]) == budget.seconds == 4.0
    assert budget.seconds_for([6.0, 1.0]) == 6.0  # a replica whose floor takes 6 s: let in
    # a claim of any slowness (unchecked: a stranger's record) at most holds the fast ones to their cap
    assert budget.seconds_for([3600.0]) == 8.0
    assert budget.seconds_for([float("nan"), float("inf"), -5.0, 0.0]) == 4.0  # nonsense is no floor
    # what a replica puts in its record: floor × pace (+ a chain's drain), within what the schema takes
    assert floor_seconds(2, None, 600.0) is None and floor_seconds(2, 1.5, 600.0, 0.5) == 3.5
    assert floor_seconds(2, 1e6, 600.0) == 600.0 and floor_seconds(2, 0.0, 600.0) > 0


def test_a_slow_replica_asks_for_the_floor_that_keeps_it_busy():
    # a quarter core: 3.5 s a step, 1 s to close a round; at 1 step it would train 0.78 of its round
    assert busy_floor(1, 20, 3.5, 1.0) == 3  # 3 steps: 10.5 / 11.5 = 0.91
    assert 3 * 3.5 / (3 * 3.5 + 1.0) >= BUSY_SHARE > 2 * 3.5 / (2 * 3.5 + 1.0)
    assert busy_floor(1, 20, 0.5, 0.05) == 1  # a close of a tenth of a step: the config's floor does
    assert busy_floor(4, 20, 0.5, 0.05) == 4  # never below the config's floor
    assert busy_floor(1, 6, 0.1, 10.0) == 6  # never past the cap
    assert busy_floor(2, 8, None, 1.0) == busy_floor(2, 8, 1.0, None) == busy_floor(2, 8, 0.0, 1.0) == 2


def test_a_replica_steps_to_the_budget_within_the_floor_and_the_cap():
    kw = {"floor": 2, "cap": 8, "nominal": 4}

    def steps_in(budget_s, step_s):
        steps, elapsed = 0, 0.0
        while another_step(steps, elapsed, step_s, budget_s, **kw):
            steps, elapsed = steps + 1, elapsed + (step_s or 1.0)
        return steps

    assert steps_in(None, 1.0) == 4 and steps_in(10.0, None) == 4  # no budget or no timing: H
    assert steps_in(4.0, 1.0) == 4
    assert steps_in(2.5, 1.0) == 2  # never past the budget...
    assert steps_in(1.0, 1.0) == 2  # ...but the floor always
    assert steps_in(100.0, 1.0) == 8  # never past the cap
    assert not sits_out(4.0, 1.0, 2) and not sits_out(None, 9.0, 2) and not sits_out(4.0, None, 2)
    assert sits_out(4.0, 4.0 * SIT_OUT_SLACK / 2 + 0.01, 2)  # its floor would overrun the budget


def test_the_schedule_moves_by_round_whatever_the_pace():
    H, cap = 10, 20
    for round_ in (0, 7):
        positions = [schedule_position(round_, step, H, cap) for step in range(cap)]
        assert positions == sorted(positions)
        assert positions[0] == round_ * H and positions[-1] < (round_ + 1) * H
        assert schedule_position(round_, 10**6, H, cap) == positions[-1]  # past the cap: no further
    assert schedule_position(3, 2, H, H) == 3 * H + 2  # at the cap of H: one position per step


def test_paced_config_defaults_and_checks(tiny_config):
    paced = replace(tiny_config, "outer", schedule="paced", inner_steps=10)
    assert (paced.outer.step_floor, paced.outer.step_cap) == (2, 20)
    steps = replace(tiny_config, "outer", inner_steps=10)
    assert (steps.outer.step_floor, steps.outer.step_cap) == (10, 10)


@pytest.mark.parametrize(
    "outer, key",
    [
        ('schedule = "hurried"', "outer.schedule"),
        ('schedule = "paced"\ninner_steps = 10\nmin_inner_steps = 11', "outer.min_inner_steps"),
        ('schedule = "paced"\ninner_steps = 10\nmax_inner_steps = 9', "outer.min_inner_steps"),
        ("min_round_s = 0", "outer.min_round_s"),
        ("min_round_s = 20.0\nmax_round_s = 10.0", "outer.min_round_s"),
    ],
)
def test_paced_config_errors_name_the_key(tmp_path, outer, key):
    path = tmp_path / "bad.toml"
    path.write_text(f"[outer]\n{outer}\n")
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        load_config(path)


def test_a_paced_seal_waits_no_longer_than_its_budget_allows_whatever_the_deadline_learned():
    # a late replica taught the deadline 40 s; the round's budget is 3 s: the seal goes at 1.5 budgets
    assert paced_deadline(40.0, 2.0, 3.0) == pytest.approx(PACED_WAIT_BUDGETS * 3.0)
    assert paced_deadline(2.5, 2.0, 3.0) == 2.5  # a shorter learned deadline stays
    assert paced_deadline(40.0, 2.0, 0.5) == 2.0  # never below the floor
    assert paced_deadline(40.0, 2.0, None) == 40.0  # steps rounds, or no budget yet: as learned


def test_a_late_start_ends_with_the_swarms_round():
    # the seal of round 6 seen at t = 100 s, budget 6 s: the swarm's round 7 ends near 106 s
    assert round_budget_left(6.0, 103.0, 7, (6, 100.0)) == 3.0  # began 3 s late: 3 s left
    assert round_budget_left(6.0, 99.0, 7, (6, 100.0)) == 6.0  # began before that seal (overlap): its own
    assert round_budget_left(6.0, 108.0, 7, (6, 100.0)) == 0.0  # past it: the floor's steps only
    assert round_budget_left(6.0, 103.0, 7, (5, 90.0)) == 6.0  # no seal of the round before yet
    assert round_budget_left(6.0, 103.0, 7, None) == 6.0
    assert round_budget_left(None, 103.0, 7, (6, 100.0)) is None  # no budget: the nominal H
    # with the floor, a replica that is out of time still takes its floor's steps and announces
    assert another_step(0, 0.0, 0.5, round_budget_left(6.0, 108.0, 7, (6, 100.0)), 1, 10, 5)
    assert not another_step(1, 0.5, 0.5, round_budget_left(6.0, 108.0, 7, (6, 100.0)), 1, 10, 5)
