"""One anchor's round as every replica computes it: from θ (`hetnode.replica.global_model`), train its
assigned batches (`planning.rounds.assigned_batches`) on its data slot, H steps or as many as a paced
round's budget allows, with the working weights kept across rounds (`LocalRounds`: the rebase onto each
new θ, Δ with error feedback per round).

The daemon's anchor (`hetnode/daemon/rounds.py`) adds its glue to this object: the payload messages, the
close off the training thread, the state file, the faults hook; the lab's in-process benches
(`hetnode/lab/sim/replicas.py`) drive it as it is, so what they measure is the code a peer runs."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Protocol

import torch

from hetnode.algo.sparseloco import ErrorFeedback, SparseLoCoCodec
from hetnode.config import Config
from hetnode.data.dataset import TokenDataset
from hetnode.model.decoder import build_model
from hetnode.model.shards import shard_names
from hetnode.model.subspace import SubspaceConstraint
from hetnode.planning.layer_split import split_layers
from hetnode.planning.rounds import NUM_DATA_SLOTS, another_step, assigned_batches, data_slot, sits_out
from hetnode.replica.global_model import base_fixed_embedding
from hetnode.training.local_rounds import AheadFrom, LocalRounds, Rebase, RebaseInbox, RoundTiming
from hetnode.training.schedule import schedule_position
from hetnode.training.step_clock import StepClock, moving_pace
from hetnode.training.trainer import InnerTrainer, StepResult
from hetnode.training.working_copy import WorkingCopy

log = logging.getLogger(__name__)


class Theta(Protocol):
    """What a round reads of θ: the parameters after round `params_round` (a `GlobalModel`, a stale
    peer's old copy, or an in-process replica's)."""

    params: dict[str, torch.Tensor]
    params_round: int


def anchor_constraint(config: Config) -> SubspaceConstraint | None:
    """Anchors are constrained only in the `everything` mode, at the even split's last boundary."""
    if config.pipeline.compression != "everything" or config.pipeline.stages < 2:
        return None
    splits = split_layers(config.model.n_layers, [1.0] * config.pipeline.stages)
    return SubspaceConstraint.create(
        config.model, config.pipeline.subspace_rank, splits[-1].start, config.run.seed
    )


@dataclass
class RoundWork:
    """One round's inner steps, done: its Δ is `local.pseudo_gradient()` until compressed. `round` may be
    later than the round asked for: θ of a newer round landed while it trained (a catch-up)."""

    round: int
    timing: RoundTiming
    tokens: int
    loss: float
    steps: int
    sat_out: bool = False  # paced: no step taken, too slow for the budget


class AnchorRound:
    """A full replica: working weights trained round after round on the assigned batches of its data slot
    (`peer_id`'s), rebased onto each new θ, its Δ kept in `local` for the caller to compress."""

    def __init__(
        self,
        config: Config,
        dataset: TokenDataset,
        peer_id: str,
        device: str = "cpu",
        ahead_from: AheadFrom = "eager",
    ) -> None:
        """`ahead_from`: where a round ahead trains from until θ lands (`LocalRounds`; the others are
        measured in `benchmarks/overlap_rule.py`)."""
        self.config = config
        self.peer_id = peer_id
        self.model = build_model(config.model, seed=config.run.seed).to(device)
        constraint = anchor_constraint(config)
        self.working = WorkingCopy(constraint, base_fixed_embedding(config))
        self.trainer = InnerTrainer(
            config,
            self.model,
            dataset,
            device,
            slots=[data_slot(peer_id)],
            num_slots=NUM_DATA_SLOTS,
            constraint=constraint,
        )
        # no host sync per inner step: a non-finite loss is checked once a round (`train`)
        self.trainer.deferred_checks = True
        o = config.outer
        self.feedback = ErrorFeedback(SparseLoCoCodec(o.topk, o.tile), o.error_feedback)
        params = dict(self.model.named_parameters())
        self.local = LocalRounds(params, self.feedback, ahead_from, config.outer.lr)
        self.shards = shard_names(self.local.params)
        self.last_loss = float("nan")
        self.budget_s: float | None = None  # paced: the newest round budget (set before each round)
        self.step_s: float | None = None  # paced: our inner step's time, a moving average

    def rebase_from(
        self,
        theta: Theta,
        next_round: int | None = None,
        left_out: tuple[int, ...] = (),
        contributors: int = 1,
    ) -> Rebase:
        """θ as this replica trains it (blocking: the projection costs a few matrix products). Call it while
        nothing steps θ; the rebase holds copies, so a later apply cannot change what it carries."""
        reference, fixed = self.working.prepare(theta.params)
        projected = self.working.constraint is not None
        copies = {n: t.clone() for n, t in theta.params.items()} if projected else reference
        return Rebase(
            theta.params_round,
            theta.params_round + 1 if next_round is None else next_round,
            reference,
            fixed,
            copies,
            getattr(theta, "seal_hash", None),
            tuple(left_out),
            1.0 / max(1, contributors),
        )

    def rebase(self, rebase: Rebase) -> None:
        """Stand on a new θ now (the training thread idle, or from inside it)."""
        self.local.rebase(rebase)
        self._rebased()

    def _rebased(self) -> None:
        """After every rebase (the daemon's anchor also saves its local state here)."""
        if self.local.fixed is not None:
            self.model.fixed_embedding = self.local.fixed.to(self.trainer.device)

    def train(self, round_: int, inbox: RebaseInbox | None = None, steps: int | None = None) -> RoundWork:
        """Train round `round_` from the working weights (blocking: run it in a worker thread), taking the
        rebases `inbox` delivers between inner steps; return once θ of the round before is here, its Δ
        ready to compress. `steps`: exactly this many inner steps, within the cap (benchmarks that fix
        each replica's pace); else H, or under paced rounds as many as the budget allows."""
        o = self.config.outer
        H, floor, most, budget = o.inner_steps, o.step_floor, o.step_cap, self.budget_s
        timing = RoundTiming(started_at=time.time())
        tokens_before = self.trainer.tokens
        round_ = max(round_, self.local.next_round)
        if steps is not None:
            floor = most = min(max(steps, 1), o.step_cap)
        elif o.paced and sits_out(budget, self.step_s, floor):
            log.warning(
                "round %d: sitting it out: %d steps take about %.1f s here, the round's budget is %.1f s",
                round_,
                floor,
                floor * (self.step_s or 0.0),
                budget or 0.0,
            )
            return RoundWork(round_, timing, 0, self.last_loss, 0, sat_out=True)
        # a late joiner trains at the swarm's point of the schedule, not in a warmup of its own
        self.trainer.schedule_offset = max(0, round_ * H - self.trainer.step)
        # on a GPU nothing in this loop reads a tensor: steps are timed by `StepClock`, the loss and the
        # finite check are read once, after the last step
        clock = StepClock(self.trainer.device)
        step, last = 0, None
        while True:
            self.local.take_closed(wait=False)  # first: a rebase may settle the round it holds
            if self.local.take_rebases(inbox, timing, step):
                self._rebased()
                round_ = max(round_, self.local.next_round)
            # overlapped, a replica whose round ends before θ of the round before is here would stand still
            # until it is (`wait_for_base`): it takes another step instead, within its cap
            idle = o.paced and inbox is not None and self.local.next_round < round_ and step < most
            if not idle and not another_step(
                step, clock.elapsed(self.step_s), self.step_s, budget, floor, most, H
            ):
                break
            batch = assigned_batches(self.peer_id, round_, step + 1, o.step_cap)[step]
            # paced: the schedule moves by round, whatever our pace (`schedule_position`)
            position = schedule_position(round_, step, H, o.step_cap) if o.paced else None
            clock.begin()
            last = self.trainer.train_step(batch_index=batch, position=position)
            self._timed(timing, clock.end())
            step += 1
        self._timed(timing, clock.finish())
        self._finished(round_, last)
        waited = time.monotonic()
        self.local.take_closed(wait=True)  # the round before's payload, if still being made
        timing.wait_s += time.monotonic() - waited
        before = len(timing.rebased_at_step)
        self.local.wait_for_base(inbox, round_, timing)
        if len(timing.rebased_at_step) > before:
            self._rebased()
        round_ = max(round_, self.local.next_round)
        return RoundWork(round_, timing, self.trainer.tokens - tokens_before, self.last_loss, step)

    def _timed(self, timing: RoundTiming, measured: tuple[float, int] | None) -> None:
        if measured is not None:
            seconds, steps = measured
            timing.train_s += seconds
            self.step_s = moving_pace(self.step_s, seconds, steps)

    def _finished(self, round_: int, last: StepResult | None) -> None:
        """After a round's last step: raise if any step's loss was not finite, before anything of the
        round is compressed (so no such step reaches a payload), then read its last loss (for its log)."""
        try:
            self.trainer.check_finite()
        except FloatingPointError as exc:
            log.error("round %d: %s; stopping before anything of it is sent or saved", round_, exc)
            raise
        if last is not None:
            self.last_loss = last.loss

    def restore_unsent(self) -> None:
        """Every payload not yet settled was not sealed: back into the error-feedback buffers."""
        self.local.restore(list(self.local.unsent))

    @property
    def tokens(self) -> int:
        return self.trainer.tokens

    def feedback_norm(self) -> float:
        return (
            float(sum(b.pow(2).sum() for b in self.feedback.buffers.values()) ** 0.5)
            if self.feedback.buffers
            else 0.0
        )
