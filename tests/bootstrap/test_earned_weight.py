"""Weight earned by verified history (`bootstrap/earned_weight.py`): probation, growth, halving, strikes."""

import pytest

from bootstrap.earned_weight import STRIKE_SCORE, EarnedWeight


def test_weight_grows_by_one_per_non_negative_score_up_to_full_and_a_negative_one_halves_it():
    earned = EarnedWeight(full=8)
    assert earned.weight("p") == 0 and not earned.anyone  # on probation
    assert [earned.observe("p", 0.9) for _ in range(10)] == [1, 2, 3, 4, 5, 6, 7, 8, 8, 8]
    assert earned.observe("p", -0.05) == 4  # noisy, not a strike
    assert earned.observe("p", -0.05) == 2 and earned.observe("p", -0.05) == 1
    assert earned.observe("p", -0.05) == 1  # once verified, never back on probation for a noisy round
    assert earned.ceiling("p") == 8


def test_each_strike_halves_the_ceiling_for_good_and_enough_of_them_leave_no_weight():
    earned = EarnedWeight(full=8)
    for _ in range(6):
        earned.observe("sly", 0.9)
    strike = STRIKE_SCORE - 0.3
    assert earned.observe("sly", strike) == 3 and earned.ceiling("sly") == 4
    # honest rounds after a strike earn back no more than the ceiling
    assert max(earned.observe("sly", 0.9) for _ in range(20)) == 4
    assert earned.observe("sly", strike) == 2 and earned.ceiling("sly") == 2
    earned.observe("sly", strike)
    assert earned.ceiling("sly") == 1 and earned.weight("sly") == 1
    assert earned.observe("sly", strike) == 0 and earned.ceiling("sly") == 0
    assert earned.observe("sly", 0.9) == 0  # out of weight for good: a new identity starts on probation
    assert earned.in_seal(["sly", "other"]) == {"sly": 1, "other": 1}  # nobody else earned: all count 1


@pytest.mark.parametrize("weight, strikes, expected", [(8, 0, 8), (8, 1, 4), (3, 2, 2), (5, 4, 0)])
def test_a_restart_takes_up_weights_and_strikes(weight, strikes, expected):
    earned = EarnedWeight(full=8)
    earned.restore({"p": weight, "old": None}, {"p": strikes, "old": 0})
    assert earned.weight("p") == expected and earned.weight("old") == 0
    assert earned.ceiling("p") == 8 >> strikes
