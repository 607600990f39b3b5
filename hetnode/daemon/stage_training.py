"""One stage of a chain in the daemon: the stage's round (`hetnode.training.stage_round.StageRound`) with the
daemon's glue: the payload messages per shard it owns, the limits of the frames it accepts (`frame_limits`)
and the first stage's word on a round's T_fix' (`drift_refusal`), its local state file. Blocking methods
(run them in a worker thread); no networking here.
"""

from __future__ import annotations

import pickle
from collections.abc import Sequence
from pathlib import Path

import torch

from hetnode.config import Config
from hetnode.daemon.rounds import write_state
from hetnode.data.dataset import TokenDataset
from hetnode.errors import CheckpointError
from hetnode.replica.global_model import GlobalModel
from hetnode.training.local_rounds import AheadFrom, snapshot_optimizer
from hetnode.training.stage_round import KEPT_EMBEDDINGS, StageRound, stage_part
from hetnode.wire.activation_frame import FrameLimits, value_bounds
from hetnode.wire.sync_payload import SyncPayload, encode_payload


def drift_refusal(round_: int, base: int, oldest: int, newest: int) -> str | None:
    """Why a stage refuses the first stage's word that round `round_`'s T_fix' comes from θ after round
    `base` (None: taken). `oldest`: the first round this stage could still train; `newest`: the newest
    round it began or was named a θ round for (one drift frame a round, before its first act frame).

    An honest first stage names the θ it stands on, a round or two back (at most one round is unapplied);
    a θ further back than `KEPT_EMBEDDINGS` rounds is one no stage keeps. Whether a θ ahead of this stage
    is within reach is decided when the round opens (the chain's `_hold_embedding_after`)."""
    if round_ <= newest:
        return f"a second drift frame for round {round_} (this stage is at round {newest} already)"
    if round_ < oldest:
        return f"a drift frame for round {round_}, which is not the next round"
    if base < round_ - KEPT_EMBEDDINGS:
        return (
            f"round {round_}'s T_fix' from θ after round {base}: more than {KEPT_EMBEDDINGS} rounds back, "
            "where no stage keeps θ's embedding"
        )
    return None


def frame_limits(config: Config, compressed: bool) -> FrameLimits:
    """What a stage accepts from its neighbours: the chain's batch shape, width k or d, dtype and value
    bounds (from d) and, when compressed, the first stage's V×d embedding drift once per round."""
    max_act, max_grad = value_bounds(config.model.d_model)
    return FrameLimits(
        config.data.batch_size,
        config.data.seq_len,
        config.pipeline.subspace_rank if compressed else config.model.d_model,
        "bf16" if compressed else "fp32",
        config.model.vocab_size,
        int(config.network.max_frame_mb * 2**20),
        d_model=config.model.d_model if compressed else 0,
        max_act=max_act,
        max_grad=max_grad,
    )


class StageTraining(StageRound):
    """A chain member's stage (`StageRound`), its round's Δ encoded per shard and its state saved."""

    def __init__(
        self,
        config: Config,
        splits: Sequence[range],
        index: int,
        chain: str,
        dataset: TokenDataset | None,
        device: str = "cpu",
        compress: bool | None = None,
        ahead_from: AheadFrom = "eager",
    ) -> None:
        super().__init__(config, splits, index, chain, dataset, device, compress, ahead_from)
        part = stage_part(splits, index, self.compressed)
        # what a saved state names (a state from before stages held the embedding restores its feedback only)
        self.part = [part.layers.start, part.layers.stop, part.first, part.last, part.embed]

    @property
    def limits(self) -> FrameLimits:
        return frame_limits(self.config, self.compressed)

    def end_round(self, round_: int, replica: str) -> dict[str, bytes]:
        """This stage's compressed Δ for `round_` (`compress`), one encoded message per shard it owns (the θ
        it was trained from in the header). Call it once θ of the round before is stood on."""
        compressed = self.compress(round_)
        return {
            shard: encode_payload(
                SyncPayload(
                    replica,
                    round_,
                    shard,
                    "sparseloco",
                    {n: compressed[n] for n in names},
                    base=self.local.base,
                )
            )
            for shard, names in self.shards.items()
        }

    def local_state(self) -> dict:
        """What a restart needs to go on, as of the last rebase (copies: training goes on at once): our
        slice of θ and its round, the error feedback with every earlier payload settled, the stage's
        optimiser and schedule position, and the data position. Not the working weights: a restart
        stands on θ again."""
        p = self.local
        return {
            "part": self.part,
            "params_round": p.base,
            "seal_hash": p.base_seal,
            "global_params": p.theta,
            "feedback": self.feedback.state_dict(),
            "optimizer": snapshot_optimizer(self.worker.optimizer),
            "version": self.worker.version,
            "applied": self.worker.applied,
            "tokens": self.tokens,
            "next_mb": self.next_mb,
        }

    def save_local_state(self, path: Path) -> None:
        """Write `local_state` (to a file, then renamed: a crash never leaves half a state)."""
        write_state(path, self.local_state())

    def load_local_state(self, path: Path, global_model: GlobalModel) -> str | None:
        """Restore a saved state into `global_model` (stand on it with `rebase` next); returns what was
        restored, None when there is none.

        "all" for the same layers as before. A stage of another chain may hold other layers: then only
        the error feedback of the tensors it still holds is taken (what they still owe to θ); its θ comes
        from a catch-up and its optimiser starts afresh."""
        if not path.exists():
            return None
        try:
            state = torch.load(path, map_location="cpu", weights_only=True)
            same = state["part"] == self.part
            feedback = state["feedback"]
            held = {n: b for n, b in feedback["buffers"].items() if n in self.names}
            if any(tuple(b.shape) != tuple(global_model.params[n].shape) for n, b in held.items()):
                raise CheckpointError(f"{path} was saved for another model")
            self.feedback.load_state_dict({"beta": feedback["beta"], "buffers": held})
            if not same:
                return "feedback"
            params = state["global_params"]
            if {n: tuple(t.shape) for n, t in params.items()} != {
                n: tuple(t.shape) for n, t in global_model.params.items()
            }:
                raise CheckpointError(f"{path} was saved for another model")
            self.worker.optimizer.load_state_dict(state["optimizer"])
            self.worker.version = int(state["version"])
            self.worker.applied = int(state.get("applied", state["version"]))
            self.tokens, self.next_mb = int(state["tokens"]), int(state["next_mb"])
        except (OSError, KeyError, RuntimeError, ValueError, TypeError, pickle.UnpicklingError) as exc:
            raise CheckpointError(f"{path} is unreadable ({exc}); move it away to start fresh") from None
        with torch.no_grad():
            for name, tensor in params.items():
                global_model.params[name].copy_(tensor)
        global_model.params_round = int(state["params_round"])
        seal_hash = state.get("seal_hash")
        global_model.seal_hash = seal_hash if isinstance(seal_hash, str) else None
        global_model.changed()
        return "all"
