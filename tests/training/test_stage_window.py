"""How many micro-batches each stage of a networked chain keeps unanswered."""

from __future__ import annotations

import pytest

from hetnode.training.schedule import stage_window


@pytest.mark.parametrize("stages", [2, 3, 6])
def test_the_default_is_the_1f1b_schedule(stages):
    # P − s in flight on stage s: its weight delay is P−1−s, as in the papers and the simulator
    assert [stage_window(stages, s) for s in range(stages)] == [stages - s for s in range(stages)]


def test_a_wider_window_adds_the_same_staleness_to_every_stage():
    assert [stage_window(3, s, max_in_flight=5) for s in range(3)] == [5, 4, 3]
    assert [stage_window(3, s, max_in_flight=1) for s in range(3)] == [1, 1, 1]  # never below one


def test_a_stage_outside_the_chain_is_an_error():
    with pytest.raises(ValueError, match="not in a chain of 2"):
        stage_window(2, 2)
