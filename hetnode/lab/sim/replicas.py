"""Replicas as the outer loop sees them: an anchor (one full model) or a chain (a pipeline of stages).

Both keep the global parameters θ^t exactly as every other replica has them, train a *working copy*
for H inner steps, and report the pseudo-gradient against the copy they started from. Under the subspace
constraint the working copy is P(θ^t) and the embedding's out-of-subspace part joins the frozen table,
T_fix' = T_fix + (T_S − P(T_S)), so the working input embedding equals the global one (DESIGN §2.3).
"""

from __future__ import annotations

import dataclasses

import torch

from hetnode.algo.aggregate import NesterovOuter
from hetnode.algo.sparseloco import ErrorFeedback, SparseLoCoCodec
from hetnode.lab.sim.pipeline import PipelineChain
from hetnode.training.trainer import InnerTrainer
from hetnode.training.working_copy import WorkingCopy

Params = dict[str, torch.Tensor]


class Replica:
    """What the outer loop needs of any replica; subclasses say how the working copy trains."""

    def __init__(self, replica_id: str, global_params: Params, working: WorkingCopy, method) -> None:
        """`global_params`: θ⁰ as every replica holds it (never a projected working copy)."""
        self.id = replica_id
        self.global_params = {n: t.detach().clone() for n, t in global_params.items()}
        self.working = working
        self.reference: Params = {}
        self.feedback = (
            ErrorFeedback(SparseLoCoCodec(method.topk, method.tile), method.error_feedback)
            if method.kind == "sparseloco"
            else None
        )
        self.outer = (
            NesterovOuter(method.diloco_lr, method.diloco_momentum) if method.kind == "diloco" else None
        )
        self.activation_bytes = 0  # chain boundary frames sent forward (activations)
        self.gradient_bytes = 0  # and backward (activation gradients)

    def begin_round(self) -> None:
        self.reference, fixed = self.working.prepare(self.global_params)
        with torch.no_grad():
            for name, param in self.local_params().items():
                param.copy_(self.reference[name])
        self._set_fixed(fixed)

    def local_params(self) -> Params:
        raise NotImplementedError

    def train(self, steps: int) -> None:
        raise NotImplementedError

    @property
    def tokens(self) -> int:
        raise NotImplementedError

    def _set_fixed(self, fixed: torch.Tensor | None) -> None:
        raise NotImplementedError


class AnchorReplica(Replica):
    def __init__(
        self, replica_id: str, trainer: InnerTrainer, global_params: Params, working: WorkingCopy, method
    ) -> None:
        self.trainer = trainer
        super().__init__(replica_id, global_params, working, method)

    def local_params(self) -> Params:
        return dict(self.trainer.model.named_parameters())

    def train(self, steps: int) -> None:
        for _ in range(steps):
            self.trainer.train_step()

    @property
    def tokens(self) -> int:
        return self.trainer.tokens

    def _set_fixed(self, fixed: torch.Tensor | None) -> None:
        self.trainer.model.fixed_embedding = fixed


class ChainReplica(Replica):
    def __init__(
        self, replica_id: str, chain: PipelineChain, global_params: Params, working: WorkingCopy, method
    ) -> None:
        self.chain = chain
        self._tokens = 0
        super().__init__(replica_id, global_params, working, method)

    def local_params(self) -> Params:
        return self.chain.params()

    def train(self, steps: int) -> None:
        stats = self.chain.run(steps)  # drains at the end: one bubble per outer step
        self.chain.round += 1
        self._tokens += stats.tokens
        self.activation_bytes += stats.activation_bytes
        self.gradient_bytes += stats.gradient_bytes

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
