"""One anchor's round in the daemon: the round itself (`hetnode.training.anchor_round.AnchorRound`: from θ,
train the assigned batches and keep Δ with error feedback) with the daemon's glue around it: the payload
messages per shard, the close off the training thread, the faults hook (`hetnode.daemon.faults`), the local
state file that survives restarts."""

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

from hetnode.algo.sparseloco import CompressedTensor
from hetnode.config import Config
from hetnode.daemon.faults.strategy import HONEST, Faults
from hetnode.data.dataset import TokenDataset
from hetnode.errors import CheckpointError
from hetnode.files import atomic_write
from hetnode.replica.global_model import GlobalModel
from hetnode.training.anchor_round import AnchorRound, RoundWork
from hetnode.training.local_rounds import AheadFrom, RebaseInbox, RoundTiming
from hetnode.wire.sync_payload import SyncPayload, encode_payload

if TYPE_CHECKING:
    from hetnode.daemon.faults.anchor import OldTheta

log = logging.getLogger(__name__)


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


class AnchorTraining(AnchorRound):
    """The anchor's round (`AnchorRound`) as the daemon runs it: its Δ made by the faults strategy (honest:
    error feedback), in line or off the training thread, and encoded per shard; its state saved per rebase."""

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
        `ahead_from`: where a round ahead trains from until θ lands (`LocalRounds`)."""
        super().__init__(config, dataset, peer_id, device, ahead_from)
        self.faults = faults
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

    def run_round(
        self, round_: int, theta: GlobalModel | OldTheta, steps: int | None = None
    ) -> dict[str, bytes]:
        """Lockstep in one call (blocking): stand on `theta`, train round `round_` (`steps`: exactly so
        many, as `train_round`), return its payload."""
        self.rebase(self.rebase_from(theta, next_round=round_))
        return self.train_round(round_, steps=steps).payloads

    def _rebased(self) -> None:
        super()._rebased()
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
        """Train round `round_` (`AnchorRound.train`, blocking: run it in a worker thread), then make its
        payload: in line, or handed to the closer while the training thread returns."""
        work = self.train(round_, inbox, steps)
        if work.sat_out:
            return TrainedRound(work.round, {}, work.timing, 0, work.loss, 0)
        if self.closer is not None:
            return self._close_aside(work)
        closing = time.monotonic()
        compressed = self.faults.round_update(self.local, work.round, self.peer_id, self.config.outer)
        payloads = self._encode(work.round, compressed)
        self._closed(work.timing, time.monotonic() - closing)
        return TrainedRound(work.round, payloads, work.timing, work.tokens, work.loss, work.steps)

    def _close_aside(self, work: RoundWork) -> TrainedRound:
        """Split the round's Δ off and compress it on the closer; the training thread returns at once."""
        round_, timing = work.round, work.timing
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
        return TrainedRound(round_, {}, timing, work.tokens, work.loss, work.steps, closing=future)

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
