"""One anchor's inner loop: from θ (`hetnode.replica.global_model`), train H steps on its data slot and
compress the pseudo-gradient with error feedback; its local state survives restarts."""

from __future__ import annotations

import hashlib
import logging
import pickle
from pathlib import Path

import torch

from hetnode.algo.sparseloco import CompressedTensor, ErrorFeedback, SparseLoCoCodec, pseudo_gradient
from hetnode.config import Config
from hetnode.data.dataset import TokenDataset
from hetnode.errors import CheckpointError
from hetnode.model.decoder import build_model
from hetnode.model.subspace import SubspaceConstraint
from hetnode.planning.layer_split import split_layers
from hetnode.planning.rounds import assigned_batches
from hetnode.replica.global_model import GlobalModel, base_fixed_embedding
from hetnode.training.faults import PSEUDO_GRADIENT_FAULTS, corrupt
from hetnode.training.trainer import InnerTrainer
from hetnode.training.working_copy import WorkingCopy
from hetnode.wire.sync_payload import SyncPayload, encode_payload

log = logging.getLogger(__name__)

NUM_DATA_SLOTS = 256  # replicas pick a slot from their peer id; slots are disjoint slices of the data


def anchor_constraint(config: Config) -> SubspaceConstraint | None:
    """Anchors are constrained only in the `everything` mode, at the even split's last boundary."""
    if config.pipeline.compression != "everything" or config.pipeline.stages < 2:
        return None
    splits = split_layers(config.model.n_layers, [1.0] * config.pipeline.stages)
    return SubspaceConstraint.create(
        config.model, config.pipeline.subspace_rank, splits[-1].start, config.run.seed
    )


def data_slot(peer_id: str) -> int:
    return int.from_bytes(hashlib.sha256(peer_id.encode()).digest()[:4], "big") % NUM_DATA_SLOTS


class AnchorTraining:
    """A full replica: from θ, train H steps on its data slot, compress Δ with error feedback."""

    def __init__(
        self,
        config: Config,
        dataset: TokenDataset,
        peer_id: str,
        device: str = "cpu",
        fault: str | None = None,
    ) -> None:
        """`fault`: tests and benchmarks only, a pseudo-gradient fault (`hetnode.training.faults`)."""
        self.config = config
        self.peer_id = peer_id
        self.fault = fault if fault in PSEUDO_GRADIENT_FAULTS else None
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
        o = config.outer
        self.feedback = ErrorFeedback(SparseLoCoCodec(o.topk, o.tile), o.error_feedback)
        self.last_loss = float("nan")
        self._unsent: dict[str, CompressedTensor] = {}  # the last round's payload, until it is sealed

    def run_round(self, round_: int, global_model: GlobalModel) -> dict[str, bytes]:
        """Train one round (blocking: run it in a worker thread) and return the encoded payload per shard."""
        reference, fixed = self.working.prepare(global_model.params)
        with torch.no_grad():
            for name, param in self.model.named_parameters():
                param.copy_(reference[name])
        if fixed is not None:
            self.model.fixed_embedding = fixed.to(self.trainer.device)
        # a late joiner trains at the swarm's point of the schedule, not in a warmup of its own
        self.trainer.schedule_offset = max(0, round_ * self.config.outer.inner_steps - self.trainer.step)
        for batch in assigned_batches(self.peer_id, round_, self.config.outer.inner_steps):
            self.last_loss = self.trainer.train_step(batch_index=batch).loss
        local = {n: p.detach().cpu() for n, p in self.model.named_parameters()}
        delta = pseudo_gradient(reference, local)
        if self.fault is None:
            compressed = self.feedback.compress(delta)
        else:  # a faulty peer keeps no error feedback: what it sends is exactly its fault, round after round
            seed = round_ * NUM_DATA_SLOTS + data_slot(self.peer_id)  # each faulty peer its own noise
            delta = corrupt(self.fault, delta, self.config.outer.max_value, seed=seed)
            o = self.config.outer
            compressed = ErrorFeedback(SparseLoCoCodec(o.topk, o.tile), o.error_feedback).compress(delta)
        self._unsent = compressed if self.fault is None else {}  # a faulty peer has nothing to restore
        base = global_model.params_round  # the θ we trained from: round − 1 unless we are stale
        return {
            shard: encode_payload(
                SyncPayload(
                    self.peer_id, round_, shard, "sparseloco", {n: compressed[n] for n in names}, base=base
                )
            )
            for shard, names in global_model.shards.items()
        }

    def restore_unsent(self) -> None:
        """The last payload was not sealed: add it back to the error-feedback buffers (nothing is lost)."""
        self.feedback.restore(self._unsent)
        self._unsent = {}

    @property
    def tokens(self) -> int:
        return self.trainer.tokens

    def save_local_state(self, path: Path, global_model: GlobalModel) -> None:
        """What a restart needs to go on: θ and its round, error feedback, inner optimiser."""
        state = {
            "params_round": global_model.params_round,
            "seal_hash": global_model.seal_hash,
            "global_params": global_model.params,
            "feedback": self.feedback.state_dict(),
            "trainer": self.trainer.state_dict(),
        }
        tmp = path.with_suffix(".tmp")
        torch.save(state, tmp)
        tmp.replace(path)

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
            self.trainer.load_state_dict(state["trainer"])
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
        return True

    def feedback_norm(self) -> float:
        return (
            float(sum(b.pow(2).sum() for b in self.feedback.buffers.values()) ** 0.5)
            if self.feedback.buffers
            else 0.0
        )
