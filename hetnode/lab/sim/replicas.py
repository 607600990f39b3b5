"""Replicas as the outer loop sees them: an anchor (one full model), a chain (a pipeline of stages) or the DDP
baseline's single trainer.

Every replica keeps the global parameters θ^t exactly as every other replica has them and, each round,
trains from them and hands back its update. An anchor is a thin driver of the round a peer's anchor runs
(`hetnode.training.anchor_round.AnchorRound`: the assigned batches of its data slot, `LocalRounds`, error
feedback), so the in-process benches measure that code. A chain trains a *working copy* for H
micro-batches and reports the pseudo-gradient against the copy it started from. Under the subspace
constraint the working copy is P(θ^t) and the embedding's out-of-subspace part joins the frozen table,
T_fix' = T_fix + (T_S − P(T_S)), so the working input embedding equals the global one (docs/chains.md,
"Subspace-compressed boundaries")."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from hetnode.algo.aggregate import NesterovOuter
from hetnode.algo.sparseloco import CompressedTensor, ErrorFeedback, SparseLoCoCodec, pseudo_gradient
from hetnode.lab.sim.pipeline import PipelineChain
from hetnode.training.anchor_round import AnchorRound
from hetnode.training.trainer import InnerTrainer
from hetnode.training.working_copy import WorkingCopy

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
    """A pipeline in one process: its working copy of θ trained for H micro-batches, its pseudo-gradient
    compressed with error feedback of its own."""

    def __init__(
        self, replica_id: str, chain: PipelineChain, global_params: Params, working: WorkingCopy, method
    ) -> None:
        self.chain = chain
        self._tokens = 0
        self.working = working
        self.reference: Params = {}
        self.feedback = (
            ErrorFeedback(SparseLoCoCodec(method.topk, method.tile), method.error_feedback)
            if method.kind == "sparseloco"
            else None
        )
        super().__init__(replica_id, global_params, method)

    def begin_round(self) -> None:
        self.reference, fixed = self.working.prepare(self.global_params)
        with torch.no_grad():
            for name, param in self.local_params().items():
                param.copy_(self.reference[name])
        self._set_fixed(fixed)

    def train(self, round_: int, steps: int) -> None:
        self.begin_round()
        stats = self.chain.run(steps)  # drains at the end: one bubble per outer step
        self.chain.round += 1
        self._tokens += stats.tokens
        self.activation_bytes += stats.activation_bytes
        self.gradient_bytes += stats.gradient_bytes

    def update(self, round_: int) -> Update:
        delta = pseudo_gradient(self.reference, self.local_params())
        return delta if self.feedback is None else self.feedback.compress(delta)

    def local_params(self) -> Params:
        return self.chain.params()

    @property
    def tokens(self) -> int:
        return self._tokens

    def _set_fixed(self, fixed: torch.Tensor | None) -> None:
        # Every stage that encodes or decodes uses this round's T_fix'; the first stage also adds it.
        for worker in self.chain.workers:
            if worker.constraint is not None and fixed is not None:
                worker.constraint = dataclasses.replace(worker.constraint, fixed=fixed)
            if worker.stage.first:
                worker.stage.fixed_embedding = fixed
