"""A chain in one process as its members run it: one `hetnode.training.stage_round.StageRound` a stage (the
object the daemon's chain member drives, `hetnode/daemon/chain.py`), its frames through the wire codec on
the 1F1B schedule (`run_1f1b`), so the in-process benches measure the code a peer runs.

A round, as the daemon's members take it: every stage stands on θ of the round before (`rebase_from`,
`rebase`), the first stage begins the round and names the θ round of its T_fix' (`drift_base`, its drift
frame in the daemon), the others begin it from that θ round; the first stage reads the round's assigned
batches of the chain's data slot (`next_batch`); at the end each stage compresses its Δ with its own error
feedback, and the chain's update is the union of the shards each stage owns."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from hetnode.algo.sparseloco import CompressedTensor
from hetnode.config import Config
from hetnode.daemon.stage_training import frame_limits
from hetnode.data import TokenDataset
from hetnode.lab.sim.pipeline import Boundaries, ChainStats, run_1f1b
from hetnode.training.anchor_round import Theta
from hetnode.training.stage_round import StageRound
from hetnode.training.stage_worker import StageWorker

Params = dict[str, torch.Tensor]


class StageChain:
    """The stages of chain `chain_id` over `splits`, driven round by round in lockstep."""

    def __init__(
        self,
        config: Config,
        splits: Sequence[range],
        chain_id: str,
        dataset: TokenDataset,
        codec: bool = True,
    ) -> None:
        """`codec`: frames cross the boundaries encoded and checked against the limits a daemon's stage
        accepts (`frame_limits`), bytes counted; else by direct call."""
        self.id = chain_id
        self.stages = [
            StageRound(config, splits, i, chain_id, dataset if i == 0 else None) for i in range(len(splits))
        ]
        compressed = self.stages[0].compressed
        self.boundaries = Boundaries(frame_limits(config, compressed) if codec else None)

    @property
    def workers(self) -> list[StageWorker]:
        return [stage.worker for stage in self.stages]

    @property
    def tokens(self) -> int:
        return self.stages[0].tokens

    def start_round(self, theta: Theta, round_: int) -> None:
        """Every stage stands on `theta` (θ after round `round_` − 1) and begins round `round_`, its T_fix'
        from the θ round the first stage names."""
        for stage in self.stages:
            stage.rebase(stage.rebase_from(theta))
        first = self.stages[0]
        first.begin_round(round_)
        for stage in self.stages[1:]:
            stage.begin_round(round_, first.drift_base)
        self.boundaries.round = round_

    def run(self, micro_batches: int) -> ChainStats:
        """The round's micro-batches on the 1F1B schedule, drained at the end (one bubble per round)."""
        return run_1f1b(self.stages, self.stages[0].next_batch, micro_batches, self.boundaries)

    def compress(self, round_: int) -> dict[str, CompressedTensor]:
        """The chain's update for `round_`: each stage's Δ with its error feedback, the shards it owns."""
        update: dict[str, CompressedTensor] = {}
        for stage in self.stages:
            compressed = stage.compress(round_)
            for names in stage.shards.values():
                update.update((name, compressed[name]) for name in names)
        return update

    def pseudo_gradient(self) -> Params:
        """The chain's dense Δ (DiLoCo: no error feedback), each stage's next round counted from here."""
        delta: Params = {}
        for stage in self.stages:
            own = stage.local.pseudo_gradient()
            for names in stage.shards.values():
                delta.update((name, own[name]) for name in names)
            stage.local.keep_progress()
        return delta

    def params(self) -> Params:
        """The working weights by global name, each from the stage that owns its shard."""
        return {
            name: stage.local.params[name]
            for stage in self.stages
            for names in stage.shards.values()
            for name in names
        }
