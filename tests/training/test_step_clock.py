"""`StepClock`: on CPU each step is timed alone (as before); on an asynchronous device it waits every
`every` steps, for the step before the newest, and counts the queued steps when asked for the time."""

from __future__ import annotations

import time
from collections.abc import Callable

import pytest

from hetnode.training.step_clock import PACE_WEIGHT, StepClock, moving_pace


class QueueMarks:
    """Stands in for CUDA events: a mark per step; a wait records which step's mark it waited for."""

    def __init__(self) -> None:
        self.marked = 0
        self.waited: list[int] = []

    def __call__(self) -> Callable[[], None]:
        self.marked += 1
        step = self.marked
        return lambda: self.waited.append(step)


def test_on_cpu_every_step_is_timed_alone():
    clock = StepClock("cpu")
    measured = []
    for _ in range(3):
        clock.begin()
        time.sleep(0.01)
        measured.append(clock.end())
    assert [steps for _, steps in measured] == [1, 1, 1]
    assert all(0.01 <= seconds < 1.0 for seconds, _ in measured)
    assert clock.finish() is None
    assert clock.elapsed(pace_s=100.0) < 1.0  # nothing is queued on a CPU


def test_on_a_device_it_waits_every_k_steps_for_the_step_before_the_newest():
    marks = QueueMarks()
    clock = StepClock("cpu", every=4, mark=marks)
    measured = []
    for _ in range(10):
        clock.begin()
        measured.append(clock.end())
    taken = [(i + 1, m[1]) for i, m in enumerate(measured) if m is not None]
    assert taken == [(4, 3), (8, 4)]  # after step 4: steps 1-3 are done; after step 8: steps 4-7
    assert marks.waited == [3, 7]  # the newest step stays queued while the host reads the time
    last = clock.finish()
    assert last is not None and last[1] == 3 and marks.waited == [3, 7, 10]
    assert clock.finish() is None


def test_elapsed_counts_the_queued_steps_at_the_pace():
    clock = StepClock("cpu", every=100, mark=QueueMarks())
    for _ in range(3):
        clock.begin()
        clock.end()
    assert clock.elapsed(pace_s=10.0) == pytest.approx(30.0, abs=0.5)  # three steps launched, none done
    assert clock.elapsed(pace_s=None) < 1.0


def test_the_pace_weighs_each_step_as_if_timed_alone():
    assert moving_pace(None, 3.0, 3) == 1.0
    assert moving_pace(2.0, 1.0, 1) == pytest.approx((1 - PACE_WEIGHT) * 2.0 + PACE_WEIGHT * 1.0)
    one_by_one = 2.0
    for _ in range(4):
        one_by_one = moving_pace(one_by_one, 0.5, 1)
    assert moving_pace(2.0, 2.0, 4) == pytest.approx(one_by_one)
