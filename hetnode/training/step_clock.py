"""`StepClock`: how long a round's inner steps take, without making the host wait for the device each step.

On a CPU a step is done when `train_step` returns, and each step is timed on its own. On a GPU
`train_step` returns as soon as its kernels are queued: timing that would time the launch, and waiting
for each step (a sync) would drain the queue and idle the GPU. So the clock marks the end of every step
in the device's queue (a CUDA event: recording one waits for nothing) and only every `every` steps waits
for a mark: the one of the step *before* the newest, so the newest is still queued and the GPU keeps
working while the host reads the time. The steps since the last wait share the time between the two waits.

Between waits the host may be a few steps ahead of the device; `elapsed` therefore counts the queued
steps at the measured pace, so the paced budget (`planning.rounds.another_step`) asks whether another
step fits after the queued ones end, not after they were launched.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

SYNC_EVERY = 8  # steps between two waits for the device (GPU only)
# the pace is a moving average over steps: each step's time weighs this much
PACE_WEIGHT = 0.2

Wait = Callable[[], None]


def cuda_mark(device: torch.device) -> Callable[[], Wait]:
    """Record an event on `device`'s current stream now; its wait returns when the device reached it."""

    def mark() -> Wait:
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(device))
        return event.synchronize

    return mark


def moving_pace(pace_s: float | None, seconds: float, steps: int) -> float:
    """The moving average of the step time after `steps` more steps that took `seconds` together (each
    step weighs PACE_WEIGHT, as if each had been timed alone)."""
    mean = seconds / steps
    if pace_s is None:
        return mean
    keep = (1.0 - PACE_WEIGHT) ** steps
    return keep * pace_s + (1.0 - keep) * mean


class StepClock:
    """One round's step times. Call `begin` before each step, `end` after it, `finish` after the last;
    `end` and `finish` return the (seconds, steps) they measured, if any."""

    def __init__(
        self, device: torch.device | str, every: int = SYNC_EVERY, mark: Callable[[], Wait] | None = None
    ) -> None:
        """`mark`: records a point in the device's queue and returns the wait for it; by default a CUDA
        event on a GPU, none on a CPU (a step is done when it returns)."""
        device = torch.device(device)
        if mark is None and device.type == "cuda":
            mark = cuda_mark(device)
        self.mark = mark
        self.every = max(1, every)
        self.began = time.monotonic()
        self.launched = 0  # steps handed to the device
        self.done = 0  # steps known to be finished at `done_at`
        self.done_at = self.began
        self._step_began = self.began
        self._before: Wait | None = None  # the wait for the end of the newest step but one
        self._newest: Wait | None = None

    def begin(self) -> None:
        self._step_began = time.monotonic()

    def end(self) -> tuple[float, int] | None:
        self.launched += 1
        if self.mark is None:  # synchronous: this step is done
            now = time.monotonic()
            took, self.done, self.done_at = now - self._step_began, self.launched, now
            return took, 1
        self._before, self._newest = self._newest, self.mark()
        if self.launched % self.every or self._before is None:
            return None
        self._before()
        return self._measured(self.launched - 1)

    def finish(self) -> tuple[float, int] | None:
        """Wait for the last step (GPU): the round's close reads the weights anyway."""
        if self._newest is None or self.done == self.launched:
            return None
        self._newest()
        return self._measured(self.launched)

    def elapsed(self, pace_s: float | None) -> float:
        """Seconds since the round began, counting the queued steps at `pace_s` each: when the work
        handed to the device so far will be done."""
        now = time.monotonic()
        queued = (self.launched - self.done) * (pace_s or 0.0)
        return max(now, self.done_at + queued) - self.began

    def _measured(self, done: int) -> tuple[float, int] | None:
        now = time.monotonic()
        seconds, steps = now - self.done_at, done - self.done
        self.done, self.done_at = done, now
        return (seconds, steps) if steps > 0 else None
