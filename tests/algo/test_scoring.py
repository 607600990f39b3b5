"""A chain stage's score from its chain's, its part alone and what its part adds to the chain."""

import pytest

from hetnode.algo.scoring import SCORE_MARGIN, stage_score


@pytest.mark.parametrize(
    ("chain", "alone", "marginal", "expected"),
    [
        (0.8, 0.002, None, 0.8),  # helps alone: the chain's score
        (-0.5, 0.002, None, 0.0),  # helps alone beside a bad neighbour: never negative (no framing)
        (0.8, -0.001, 0.003, 0.8),  # hurts alone, helps its chain (a first stage's layers): the chain's
        (-0.5, -0.001, 0.003, -0.5),  # the same in a chain whose whole update hurts: left out with it
        (0.8, -0.001, -0.004, -0.4 - SCORE_MARGIN),  # hurts alone and makes its chain worse: its cost
        (0.8, -0.002, None, -0.2 - SCORE_MARGIN),  # nothing to compare with: judged by its part alone
    ],
)
def test_a_stage_is_judged_by_what_its_part_does_to_its_chain(chain, alone, marginal, expected):
    assert stage_score(chain, alone, marginal, scale=0.01) == pytest.approx(expected)
