"""One anchor's inner loop: from θ (`hetnode.replica.global_model`), train H steps on its data slot and
compress the pseudo-gradient with error feedback; its local state survives restarts."""

from __future__ import annotations

import logging
import pickle
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from hetnode.algo.sparseloco import CompressedTensor, ErrorFeedback, SparseLoCoCodec
from hetnode.config import Config
from hetnode.daemon.faults.strategy import HONEST, Faults
from hetnode.data.dataset import TokenDataset
from hetnode.errors import CheckpointError
from hetnode.files import atomic_write
from hetnode.model.decoder import build_model
from hetnode.model.shards import shard_names
from hetnode.model.subspace import SubspaceConstraint
from hetnode.planning.layer_split import split_layers
from hetnode.planning.rounds import NUM_DATA_SLOTS, another_step, assigned_batches, data_slot, sits_out
from hetnode.replica.global_model import GlobalModel, base_fixed_embedding
from hetnode.training.local_rounds import (
    AheadFrom,
    LocalRounds,
    Rebase,
    RebaseInbox,
    RoundTiming,
)
from hetnode.training.schedule import schedule_position
from hetnode.training.step_clock import StepClock, moving_pace
from hetnode.training.trainer import InnerTrainer, StepResult
from hetnode.training.working_copy import WorkingCopy
from hetnode.wire.sync_payload import SyncPayload, encode_payload

if TYPE_CHECKING:
    from hetnode.daemon.faults.anchor import OldTheta

log = logging.getLogger(__name__)


def anchor_constraint(config: Config) -> SubspaceConstraint | None:
    """Anchors are constrained only in the `everything` mode, at the even split's last boundary."""
    if config.pipeline.compression != "everything" or config.pipeline.stages < 2:
        return None
    splits = split_layers(config.model.n_layers, [1.0] * config.pipeline.stages)
    return SubspaceConstraint.create(
        config.model, config.pipeline.subspace_rank, splits[-1].start, config.run.seed
    )


def write_state(path: Path, state: dict) -> None:
    """torch.save, atomically (`hetnode.files`): a crash never leaves half a state."""
    atomic_write(path, lambda tmp: torch.save(state, tmp))


@dataclass
class TrainedRound:
    """One round's training, ready to announce. `round` may be later than the round asked for: θ of a newer
    round landed while it trained (a catch-up), and the work goes on as that round's."""

    round: int
    payloads: dict[str, bytes]  # empty: the round was sat out (paced, too slow for the budget)
    timing: RoundTiming
    tokens: int
    loss: float
    steps: int
    closing: Future[dict[str, bytes]] | None = None  # closed aside: the payloads, once compressed

    @property
    def sat_out(self) -> bool:
        return not self.payloads and self.closing is None


class AnchorTraining:
    """A full replica: working weights trained round after round on its data slot (`LocalRounds`: the
    rebase onto each new θ, Δ with error feedback per round), its payload encoded per shard."""

    def __init__(
        self,
        config: Config,
        dataset: TokenDataset,
        peer_id: str,
        device: str = "cpu",
        faults: Faults = HONEST,
        ahead_from: AheadFrom = "eager",
    ) -> None:
        """`faults`: tests and benchmarks only, what Δ each round sends (`hetnode.daemon.faults`);
        `ahead_from`: where a round ahead trains from until θ lands (`LocalRounds`; the others are measured
        in `benchmarks/overlap_rule.py`)."""
        self.config = config
        self.peer_id = peer_id
        self.faults = faults
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
        # no host sync per inner step: a non-finite loss is checked once a round (`train_round`)
        self.trainer.deferred_checks = True
        o = config.outer
        self.feedback = ErrorFeedback(SparseLoCoCodec(o.topk, o.tile), o.error_feedback)
        params = dict(self.model.named_parameters())
        self.local = LocalRounds(params, self.feedback, ahead_from, config.outer.lr)
        self.shards = shard_names(self.local.params)
        self.last_loss = float("nan")
        self.budget_s: float | None = None  # paced: the newest round budget (set before each round)
        self.step_s: float | None = None  # paced: our inner step's time, a moving average
        # paced: from our last inner step to payloads ready (compress, encode), a moving average: on a
        # slow machine a good part of its round, which its record's floor must include
        self.close_s: float | None = None
        self.on_rebased: Callable[[dict], None] | None = None  # gets the local state to save, per rebase
        # overlap: each round's payload is made on this thread while the training thread goes on with the
        # next round (`close_aside`); None closes in line
        self.closer: ThreadPoolExecutor | None = None

    def close_aside(self) -> None:
        """From now on compress each round off the training thread (overlapped rounds only: in lockstep
        nothing trains while a round closes). Not for a faulty peer whose payload is its fault."""
        if self.closer is None and self.faults.closes_aside:
            self.closer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="round-close")

    def stop_closing(self) -> None:
        """Wait for a close in progress and let the thread go (a stop)."""
        if self.closer is not None:
            self.closer.shutdown(wait=True)
            self.closer = None

    def rebase_from(
        self,
        theta: GlobalModel | OldTheta,
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

    def run_round(
        self, round_: int, theta: GlobalModel | OldTheta, steps: int | None = None
    ) -> dict[str, bytes]:
        """Lockstep in one call (blocking): stand on `theta`, train round `round_` (`steps`: exactly so
        many, as `train_round`), return its payload."""
        self.rebase(self.rebase_from(theta, next_round=round_))
        return self.train_round(round_, steps=steps).payloads

    def rebase(self, rebase: Rebase) -> None:
        """Stand on a new θ now (the training thread idle, or from inside it)."""
        self.local.rebase(rebase)
        self._rebased()

    def _rebased(self) -> None:
        if self.local.fixed is not None:
            self.model.fixed_embedding = self.local.fixed.to(self.trainer.device)
        if self.on_rebased is None:
            return
        # one read of the device's flag: the rebase has just waited for the device (its copies to CPU)
        bad = self.trainer.first_nonfinite_step()
        if bad is None:
            self.on_rebased(self.local_state())
        else:  # the round's end raises; the state on disk stays the last finite one
            log.error("not saving the local state: step %d's loss was not finite", bad)

    def train_round(
        self, round_: int, inbox: RebaseInbox | None = None, steps: int | None = None
    ) -> TrainedRound:
        """Train round `round_` from the working weights (blocking: run it in a worker thread), taking the
        rebases `inbox` delivers between inner steps; compress only once θ of the round before is here.
        `steps`: exactly this many inner steps, within the cap (benchmarks that fix each replica's pace);
        else H, or under paced rounds as many as the budget allows."""
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
            return TrainedRound(round_, {}, timing, 0, self.last_loss, 0)
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
        if self.closer is not None:
            return self._close_aside(round_, timing, tokens_before, step)
        closing = time.monotonic()
        compressed = self.faults.round_update(self.local, round_, self.peer_id, o)
        payloads = self._encode(round_, compressed)
        self._closed(timing, time.monotonic() - closing)
        return TrainedRound(
            round_, payloads, timing, self.trainer.tokens - tokens_before, self.last_loss, step
        )

    def _close_aside(self, round_: int, timing: RoundTiming, tokens_before: int, steps: int) -> TrainedRound:
        """Split the round's Δ off and compress it on the closer; the training thread returns at once."""
        closing = time.monotonic()
        split = self.local.split(round_)
        base = self.local.base  # the θ we trained from, as at the split

        def close() -> dict[str, bytes]:
            self.local.close(split)
            if split.error is not None:
                raise split.error
            assert split.compressed is not None
            payloads = self._encode(round_, split.compressed, base)
            self._closed(timing, time.monotonic() - closing)
            return payloads

        assert self.closer is not None
        future = self.closer.submit(close)
        tokens = self.trainer.tokens - tokens_before
        return TrainedRound(round_, {}, timing, tokens, self.last_loss, steps, closing=future)

    def _encode(
        self, round_: int, compressed: dict[str, CompressedTensor], base: int | None = None
    ) -> dict[str, bytes]:
        """The round's payload per shard; `base`: the θ it was trained from (default: the one we stand on,
        round − 1 unless we are stale)."""
        base = self.local.base if base is None else base
        return {
            shard: encode_payload(
                SyncPayload(
                    self.peer_id, round_, shard, "sparseloco", {n: compressed[n] for n in names}, base=base
                )
            )
            for shard, names in self.shards.items()
        }

    def _closed(self, timing: RoundTiming, took: float) -> None:
        timing.close_s = took
        self.close_s = took if self.close_s is None else 0.8 * self.close_s + 0.2 * took

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

    def local_state(self) -> dict:
        """What a restart needs to go on, as of the last rebase: θ and its round, the error feedback with
        every earlier payload settled, the inner optimiser (copies: the training thread goes on at once).
        Not the working weights: a restart stands on θ again (3N + optimiser floats, not 5N)."""
        return {
            "params_round": self.local.base,
            "seal_hash": self.local.base_seal,
            "global_params": self.local.theta,
            "feedback": self.local.feedback_state(),
            "trainer": self.trainer.state_dict(weights=False),
        }

    def save_local_state(self, path: Path, global_model: GlobalModel) -> None:
        """Write the state of `global_model` (stood on first) to `path` (tests, and a stop)."""
        if self.local.base != global_model.params_round:
            self.rebase(self.rebase_from(global_model))
        write_state(path, self.local_state())

    def load_local_state(self, path: Path, global_model: GlobalModel) -> bool:
        """Restore a saved state (False when there is none); θ is taken only if it fits the model."""
        if not path.exists():
            return False
        try:
            state = torch.load(path, map_location="cpu", weights_only=True)
            params = state["global_params"]
            if {n: tuple(t.shape) for n, t in params.items()} != {
                n: tuple(t.shape) for n, t in global_model.params.items()
            }:
                raise CheckpointError(f"{path} was saved for another model")
            self.trainer.load_state_dict(state["trainer"])  # its weights, if saved, are replaced below
            self.feedback.load_state_dict(state["feedback"])
        except (OSError, KeyError, RuntimeError, ValueError, pickle.UnpicklingError) as exc:
            raise CheckpointError(f"{path} is unreadable ({exc}); move it away to start fresh") from None
        with torch.no_grad():
            for name, tensor in params.items():
                global_model.params[name].copy_(tensor)
        global_model.params_round = int(state["params_round"])
        global_model.changed()
        seal_hash = state.get("seal_hash")  # absent in states saved before seals were chained
        global_model.seal_hash = seal_hash if isinstance(seal_hash, str) else None
        self.rebase(self.rebase_from(global_model))
        return True

    def feedback_norm(self) -> float:
        return (
            float(sum(b.pow(2).sum() for b in self.feedback.buffers.values()) ** 0.5)
            if self.feedback.buffers
            else 0.0
        )
