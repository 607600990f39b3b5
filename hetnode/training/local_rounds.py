"""A replica's local half of the outer loop (docs/sync.md, "Overlap"): working weights that keep training
across rounds, the pseudo-gradient counted from where each round began, error feedback per round, and the
rebase onto every new θ. Pure torch; anchors and chain stages (and the in-process benchmarks) share it.

The one rule, on every path (an applied seal, a seal that left us out, θ downloaded after a failed apply
or a catch-up, a restart): when θ^t is known here, the working weights w become

    w ← P(θ^t) + (w − s),   s ← P(θ^t)

where s is the point the current round's progress counts from. A round's pseudo-gradient is Δ = s − w. In
lockstep the rebase lands before the round's first step, w = s, and this is exactly the classic reset
w ← P(θ^t). With overlap, after compressing round t the replica trains round t+1 at once, from s moved by its
own sent update at the weight the aggregate will give it (the *eager* rule, `ahead_from`), and the rebase
swaps that guess for θ^t when the seal lands, keeping what it learned since.

A round's Δ is compressed only once the round before is applied (at most one unapplied round ahead), so its
payload names the θ it was trained from. What a seal left out goes back into error feedback by the round it
belongs to, never by "the last one".

With overlap, the compression need not hold up the training thread either (`split`, `close`,
`take_closed`): at its last step the round's Δ is split off and counted from the weights as they are
(s ← w), the next round trains at once, and when the payload is ready the eager guess lands like a rebase,
w ← s_eager + (w − s). If θ of the round lands first the guess is moot and dropped; taken before the next
step, it gives exactly the weights of compressing in line.
"""

from __future__ import annotations

import copy
import threading
import time
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Literal

import torch

from hetnode.algo.sparseloco import CompressedTensor, ErrorFeedback

Params = dict[str, torch.Tensor]


class TrainingStopped(Exception):
    """The daemon is stopping: the training thread leaves its round unfinished."""


@dataclass(frozen=True)
class Rebase:
    """θ after `round` as this replica trains it, and what became of its earlier payloads.

    `reference` is the working copy P(θ) (clones: never the global model's own tensors, which the next
    apply steps in place); `theta` is θ itself (for the local-state save; the same dict as `reference`
    when nothing is projected). `next_round`: the round to train from here (`round` + 1, except for a
    test's stale peer, which trains the current round from old θ). `left_out`: rounds whose payload did
    not reach θ (back into error feedback)."""

    round: int
    next_round: int
    reference: Params
    fixed: torch.Tensor | None
    theta: Params
    seal_hash: str | None = None
    left_out: tuple[int, ...] = ()
    share: float = 1.0  # our weight in the aggregate that made θ (1 / its contributors), for "eager"


class RebaseInbox:
    """From the event loop (θ applied) to the training thread, which takes rebases between inner steps."""

    def __init__(self) -> None:
        self._items: deque[Rebase] = deque()
        self._cond = threading.Condition()
        self._closed = False

    def post(self, rebase: Rebase) -> None:
        with self._cond:
            self._items.append(rebase)
            self._cond.notify_all()

    def close(self) -> None:
        """Stop: a waiting or later `take` raises TrainingStopped."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()

    def drain(self) -> list[Rebase]:
        """What was posted and never taken (after a stop)."""
        with self._cond:
            items = list(self._items)
            self._items.clear()
            return items

    def take(self, timeout: float | None = 0.0) -> list[Rebase]:
        """Every posted rebase, oldest first; waits up to `timeout` (None: forever) for one if none is
        there. TrainingStopped once closed."""
        with self._cond:
            if timeout != 0.0:
                self._cond.wait_for(lambda: self._items or self._closed, timeout)
            if self._closed:
                raise TrainingStopped
            items = list(self._items)
            self._items.clear()
            return items


@dataclass
class ClosingRound:
    """A round's Δ split off the working weights at its last step, its payload made off the training thread
    (`LocalRounds.close`); `start` is where the round's progress counted from, `weight` the eager rule's
    α·share at the split."""

    round: int
    delta: Params
    start: Params
    weight: float
    done: threading.Event = field(default_factory=threading.Event)
    compressed: dict[str, CompressedTensor] | None = None
    sent: Params | None = None
    error: BaseException | None = None
    left_out: bool = False  # a seal left it out before it was taken back: restore it then


@dataclass
class RoundTiming:
    """Where a round's wall time went in the training thread."""

    started_at: float = 0.0  # time.time() at its first inner step
    train_s: float = 0.0  # in inner steps
    wait_s: float = 0.0  # waiting for the round before to be applied (or, closing aside, compressed)
    close_s: float = 0.0  # from the last inner step to the payload ready (in line or aside)
    rebased_at_step: list[int] = field(default_factory=list)  # inner steps done when each rebase landed


AheadFrom = Literal["eager", "local", "theta"]


class LocalRounds:
    """The working weights `params` (the trainer's own tensors, on any device) between rounds.

    `ahead_from`: where a replica trains from between compressing round t and the arrival of θ^t
    (docs/sync.md, "Overlap", with the measurement that chose it):
    - "eager" (default): θ^{t−1} moved by our own sent update at the weight the aggregate gives it,
      s − α·share·deq(Δ̂_t): the best guess of θ^t we hold;
    - "local": our own fresh weights (all of Δ_t, far more than the aggregate moves θ under top-k);
    - "theta": θ^{t−1} itself, the naive one-round delay.
    `outer_lr` is α; `share` (set by each rebase) our weight in the last aggregate, 1/contributors."""

    def __init__(
        self, params: Params, feedback: ErrorFeedback, ahead_from: AheadFrom = "eager", outer_lr: float = 1.0
    ) -> None:
        self.params = params
        self.feedback = feedback
        self.ahead_from = ahead_from
        self.outer_lr = outer_lr
        self.share = 1.0
        self.start: Params = {n: p.detach().cpu().clone() for n, p in params.items()}
        self.base = -2  # the θ round the working weights stand on (−2: none yet; −1 is θ⁰)
        self.next_round = -1  # the round they train next: nothing before it may be compressed
        self.base_seal: str | None = None
        self.unsent: dict[int, dict[str, CompressedTensor]] = {}  # round -> payload not yet settled
        self.theta: Params | None = None  # θ of `base` (what a local-state save writes)
        self.fixed: torch.Tensor | None = None
        # error feedback is written by a close off the training thread and by rebases (restores) on it
        self._feedback_lock = threading.Lock()
        self.closing: ClosingRound | None = None  # split off, not yet taken back (`take_closed`)
        self._rebased_since_split = False

    @torch.no_grad()
    def rebase(self, rebase: Rebase) -> None:
        """Stand on θ after `rebase.round`, keeping the progress since the current round began. Every
        payload of a round up to the next one to train is settled: restored when left out, else in θ or
        dropped (its fate unknown: never sent twice)."""
        self._rebased_since_split = True
        if self.closing is not None and self.closing.round in rebase.left_out:
            self.closing.left_out = True
        self.restore(rebase.left_out)
        self.unsent = {r: sent for r, sent in self.unsent.items() if r >= rebase.next_round}
        for name, param in self.params.items():
            reference = rebase.reference[name]
            progress = param.detach().cpu() - self.start[name]  # exactly 0 when no step was taken
            param.copy_((reference + progress).to(param.device))
            self.start[name] = reference  # never written in place: `theta` may share it
        self.base, self.base_seal, self.next_round = rebase.round, rebase.seal_hash, rebase.next_round
        self.share = rebase.share
        self.theta, self.fixed = rebase.theta, rebase.fixed

    def pseudo_gradient(self) -> Params:
        """Δ = s − w in float32 on CPU: what this round's inner steps moved, sign-flipped."""
        return {n: (self.start[n] - p.detach().cpu()).to(torch.float32) for n, p in self.params.items()}

    @torch.no_grad()
    def compress(self, round_: int, delta: Params | None = None) -> dict[str, CompressedTensor]:
        """Compress this round's Δ (or `delta`, a faulty peer's) with error feedback, keep the payload
        until its round is settled, and start the next round's count here."""
        sent: Params = {}
        with self._feedback_lock:
            compressed = self.feedback.compress(self.pseudo_gradient() if delta is None else delta, sent)
        self.unsent[round_] = compressed
        self.keep_progress(sent)
        return compressed

    @torch.no_grad()
    def keep_progress(self, sent: Params | None = None) -> None:
        """Where the next round starts, and counts from, until θ of this one lands (`ahead_from`); `sent`:
        the round's payload as receivers decompress it."""
        if self.ahead_from == "local":
            self.start = {n: p.detach().cpu().clone() for n, p in self.params.items()}
            return
        if self.ahead_from == "eager" and sent:
            weight = self.outer_lr * self.share
            self.start = {n: s - weight * sent[n] if n in sent else s for n, s in self.start.items()}
        for name, param in self.params.items():
            param.copy_(self.start[name].to(param.device))

    def add_feedback(self, feedback: Params) -> None:
        """Another replica's error feedback for our tensors (a stage's predecessor's): what its rounds still
        owe θ, owed by ours from now on."""
        with self._feedback_lock:
            buffers = self.feedback.buffers
            for name, tensor in feedback.items():
                held = buffers.get(name)
                if held is None:
                    buffers[name] = tensor.to(self.params[name].device, torch.float32).clone()
                else:
                    buffers[name] = held + tensor.to(held.device, held.dtype)

    def restore(self, rounds: Iterable[int]) -> None:
        """These rounds' payloads did not reach θ: back into error feedback (nothing is lost)."""
        for round_ in rounds:
            sent = self.unsent.pop(round_, None)
            if sent:
                with self._feedback_lock:
                    self.feedback.restore(sent)

    def feedback_state(self) -> dict[str, object]:
        """A copy of the error feedback that no close half-way through can tear."""
        with self._feedback_lock:
            return self.feedback.state_dict()

    @torch.no_grad()
    def split(self, round_: int) -> ClosingRound:
        """Training thread, after round `round_`'s last step: its Δ, and the next round counting from the
        weights as they are, for `close` to compress off this thread. The close before must be taken."""
        if self.closing is not None:
            raise RuntimeError(f"round {self.closing.round}'s payload was never taken back")
        delta = self.pseudo_gradient()
        closing = ClosingRound(round_, delta, self.start, self.outer_lr * self.share)
        self.start = {n: p.detach().cpu().clone() for n, p in self.params.items()}
        self.closing, self._rebased_since_split = closing, False
        return closing

    def close(self, closing: ClosingRound) -> None:
        """Any thread: compress a split-off Δ with error feedback; `closing.done` is set either way."""
        try:
            sent: Params = {}
            with self._feedback_lock:
                closing.compressed = self.feedback.compress(closing.delta, sent)
            closing.sent = sent
        except BaseException as exc:  # the training thread raises it when it takes the round back
            closing.error = exc
        finally:
            closing.done.set()

    @torch.no_grad()
    def take_closed(self, wait: bool) -> bool:
        """Training thread: take back the split-off round once compressed (`wait`: until it is): keep its
        payload until settled and land the eager guess unless θ landed since the split. True if taken."""
        closing = self.closing
        if closing is None or not (closing.done.is_set() or wait):
            return False
        closing.done.wait()
        self.closing = None
        if closing.error is not None:
            raise closing.error
        assert closing.compressed is not None and closing.sent is not None
        if closing.left_out:
            with self._feedback_lock:
                self.feedback.restore(closing.compressed)
        elif closing.round >= self.next_round:  # else sealed meanwhile: its fate unknown (`rebase`)
            self.unsent[closing.round] = closing.compressed
        if self._rebased_since_split or self.ahead_from == "local":
            return True
        sent = closing.sent if self.ahead_from == "eager" else {}
        for name, param in self.params.items():
            start = closing.start[name]
            guess = start - closing.weight * sent[name] if name in sent else start
            progress = param.detach().cpu() - self.start[name]  # since the split
            param.copy_((guess + progress).to(param.device))
            self.start[name] = guess
        return True

    def take_rebases(self, inbox: RebaseInbox | None, timing: RoundTiming, steps_done: int) -> bool:
        """Apply whatever rebases have arrived (between two inner steps: never blocks); True if any."""
        rebases = inbox.take(0.0) if inbox is not None else []
        for rebase in rebases:
            self.rebase(rebase)
            timing.rebased_at_step.append(steps_done)
        return bool(rebases)

    def wait_for_base(self, inbox: RebaseInbox | None, round_: int, timing: RoundTiming) -> None:
        """Block until the θ that `round_` is trained from is here: at most one unapplied round ahead."""
        waited = time.monotonic()
        while self.next_round < round_:
            if inbox is None:
                raise RuntimeError(f"round {round_} needs θ after round {round_ - 1}, holding {self.base}")
            for rebase in inbox.take(None):
                self.rebase(rebase)
                timing.rebased_at_step.append(-1)  # after the last step
        timing.wait_s += time.monotonic() - waited


def snapshot_optimizer(optimizer: torch.optim.Optimizer) -> dict:
    """A copy of the optimiser's state that later steps cannot change (for a save off the thread)."""
    return copy.deepcopy(optimizer.state_dict())
