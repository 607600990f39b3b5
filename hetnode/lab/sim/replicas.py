"""Replicas as the outer loop sees them: an anchor (one full model), a chain (a pipeline of stages) or the DDP
baseline's single trainer.

Every replica keeps the global parameters θ^t exactly as every other replica has them and, each round,
trains from them and hands back its update. An anchor is a thin driver of the round a peer's anchor runs
(`hetnode.training.anchor_round.AnchorRound`: the assigned batches of its data slot, `LocalRounds`, error
feedback), so the in-process benches measure that code; a chain likewise drives the rounds a chain's
members run (`hetnode.lab.sim.stage_chain.StageChain` over `hetnode.training.stage_round.StageRound`)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from hetnode.algo.aggregate import NesterovOuter
from hetnode.algo.sparseloco import CompressedTensor
from hetnode.lab.sim.stage_chain import StageChain
from hetnode.training.anchor_round import AnchorRound
from hetnode.training.trainer import InnerTrainer

Params = dict[str, torch.Tensor]
Update = dict[str, CompressedTensor] | Params  # SparseLoCo: compressed with error feedback; DiLoCo: dense Δ


@dataclass
class HeldTheta:
    """θ after `params_round` as a replica of the simulation holds it (what `AnchorRound` reads)."""

    params: Params
    params_round: int


class Replica:
    """What the outer loop needs of any replica; subclasses say how a round trains."""

    def __init__(self, replica_id: str, global_params: Params, method) -> None:
        """`global_params`: θ⁰ as every replica holds it (never a projected working copy)."""
        self.id = replica_id
        self.global_params = {n: t.detach().clone() for n, t in global_params.items()}
        self.sparse = method.kind == "sparseloco"
        self.outer = (
            NesterovOuter(method.diloco_lr, method.diloco_momentum) if method.kind == "diloco" else None
        )
        self.activation_bytes = 0  # chain boundary frames sent forward (activations)
        self.gradient_bytes = 0  # and backward (activation gradients)

    def train(self, round_: int, steps: int) -> None:
        """Train round `round_` from θ after round `round_` − 1 (`global_params`)."""
        raise NotImplementedError

    def update(self, round_: int) -> Update:
        """The trained round's update, as it is sent."""
        raise NotImplementedError

    @property
    def tokens(self) -> int:
        raise NotImplementedError


class AnchorReplica(Replica):
    """Drives a peer's anchor round in lockstep: stand on θ, train the round's assigned batches, compress."""

    def __init__(self, anchor: AnchorRound, global_params: Params, method) -> None:
        self.anchor = anchor
        super().__init__(anchor.peer_id, global_params, method)

    @property
    def trainer(self) -> InnerTrainer:
        return self.anchor.trainer

    def train(self, round_: int, steps: int) -> None:
        anchor = self.anchor
        anchor.rebase(anchor.rebase_from(HeldTheta(self.global_params, round_ - 1), next_round=round_))
        anchor.train(round_, steps=steps)

    def update(self, round_: int) -> Update:
        local = self.anchor.local
        if self.sparse:
            return local.compress(round_)
        delta = local.pseudo_gradient()  # DiLoCo sends Δ dense, without error feedback
        local.keep_progress()
        return delta

    @property
    def tokens(self) -> int:
        return self.anchor.tokens


class DDPReplica(Replica):
    """Synchronous DDP: one trainer whose every step averages all replicas' batches (no outer round)."""

    def __init__(self, trainer: InnerTrainer, global_params: Params, method) -> None:
        self.trainer = trainer
        super().__init__("ddp", global_params, method)

    @property
    def tokens(self) -> int:
        return self.trainer.tokens


class ChainReplica(Replica):
    """Drives a chain's stage rounds in lockstep (`StageChain`): every stage stands on θ, the round's
    assigned batches go through the pipeline, each stage compresses its Δ with its own error feedback."""

    def __init__(self, chain: StageChain, global_params: Params, method) -> None:
        self.chain = chain
        super().__init__(chain.id, global_params, method)

    def train(self, round_: int, steps: int) -> None:
        self.chain.start_round(HeldTheta(self.global_params, round_ - 1), round_)
        stats = self.chain.run(steps)  # drains at the end: one bubble per outer step
        self.activation_bytes += stats.activation_bytes
        self.gradient_bytes += stats.gradient_bytes

    def update(self, round_: int) -> Update:
        if self.sparse:
            return self.chain.compress(round_)
        return self.chain.pseudo_gradient()  # DiLoCo sends Δ dense, without error feedback

    @property
    def tokens(self) -> int:
        return self.chain.tokens
