"""The global model as every replica (and the coordinator) holds it, and one anchor's inner loop.

`GlobalModel.apply` is the only way θ changes: it decodes *all* sealed payloads first (each validated
against the shard's spec and checked to belong to the sealed round and replica), and only then
aggregates in the sealed order and steps, so a bad payload never leaves θ half-updated.
"""

from __future__ import annotations

import hashlib
import logging
import pickle
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from hetnode.algo.aggregate import aggregate_sparse, outer_sgd_step, unsafe_outer_step
from hetnode.algo.sparseloco import (
    CompressedTensor,
    DenseCodec,
    ErrorFeedback,
    SparseLoCoCodec,
    pseudo_gradient,
)
from hetnode.algo.subspace import frozen_embedding
from hetnode.config import Config
from hetnode.data.dataset import TokenDataset
from hetnode.errors import CheckpointError, HetnodeError, WireError
from hetnode.model.decoder import DecoderStage, build_model
from hetnode.model.shards import ModelPart, layer_digests, shard_names
from hetnode.model.subspace import SubspaceConstraint
from hetnode.planning.layer_split import split_layers
from hetnode.planning.rounds import assigned_batches
from hetnode.training.faults import PSEUDO_GRADIENT_FAULTS, corrupt
from hetnode.training.trainer import InnerTrainer
from hetnode.training.working_copy import WorkingCopy
from hetnode.wire.sync_payload import DecodedPayload, ShardSpec, SyncPayload, decode_payload, encode_payload

log = logging.getLogger(__name__)

Params = dict[str, torch.Tensor]
NUM_DATA_SLOTS = 256  # replicas pick a slot from their peer id; slots are disjoint slices of the data
# (signed envelope) -> (author peer id, payload message); raises WireError for a forged or malformed one
PayloadOpener = Callable[[bytes], tuple[str, bytes]]


class ApplyError(HetnodeError):
    """A round's aggregate would make θ non-finite; nothing was changed. `peers`: the contributors."""

    def __init__(self, round_: int, tensor: str, peers: Sequence[str]) -> None:
        self.round = round_
        self.tensor = tensor
        self.peers = tuple(peers)
        super().__init__(f"round {round_}: the step of {tensor} would not be finite in float32")


@dataclass(frozen=True)
class PreparedRound:
    """A round's aggregate, checked: committing it cannot fail or leave θ half-updated."""

    round: int
    delta: dict[str, torch.Tensor]  # dense Δ of every tensor that any contribution touched


def sha256_hex(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def base_fixed_embedding(config: Config) -> torch.Tensor | None:
    """T_fix, part of the architecture whenever a subspace mode is on (anchors add it too, so that anchors
    and chains train one function of θ); None when compression is off."""
    if config.pipeline.compression == "none":
        return None
    m = config.model
    return frozen_embedding(m.vocab_size, m.d_model, config.run.seed, m.init_std)


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


class GlobalModel:
    """θ after round `params_round` (−1: the seeded initialisation every replica starts from), or the
    slice of it that `part` names: a chain stage holds, syncs and downloads only its own layers.

    `opener` checks the author's signature on each payload (the daemons pass one; in-process users of
    bare payload messages, such as the simulator's tests, pass None)."""

    def __init__(
        self, config: Config, opener: PayloadOpener | None = None, part: ModelPart | None = None
    ) -> None:
        self.config = config
        self.opener = opener
        self.part = part or ModelPart.whole(config.model.n_layers)
        p = self.part
        # seeded per parameter name: a slice built alone holds exactly the whole model's values
        model = DecoderStage(config.model, p.layers, p.first, p.last, seed=config.run.seed)
        self.params: Params = {n: t.detach().clone() for n, t in model.named_parameters()}
        del model
        self.params_round = -1
        self._digests: dict[str, str] | None = None  # of θ as it is now (None: not computed since a change)
        self.seal_hash: str | None = ""  # of the seal that produced θ ("" before round 0, None: unknown)
        self.shards = shard_names(self.params)
        max_bytes = int(config.network.max_frame_mb * 2**20)
        o = config.outer
        self.sparse_specs = {
            shard: ShardSpec(shard, self._shapes(names), "sparseloco", o.topk, o.tile, max_bytes, o.max_value)
            for shard, names in self.shards.items()
        }
        self.dense_specs = {
            shard: ShardSpec(shard, self._shapes(names), "fp32", o.topk, o.tile, max_bytes)
            for shard, names in self.shards.items()
        }

    def _shapes(self, names: Sequence[str]) -> dict[str, tuple[int, ...]]:
        return {n: tuple(self.params[n].shape) for n in names}

    def dense_bytes(self, shards: Iterable[str]) -> int:
        """What these shards' pseudo-gradient would weigh as dense fp32 (the scale for compression)."""
        return sum(4 * self.params[n].numel() for shard in shards for n in self.shards[shard])

    @property
    def whole(self) -> bool:
        return self.part == ModelPart.whole(self.config.model.n_layers)

    def decode_contribution(
        self, replica: str, round_: int, payloads: dict[str, bytes]
    ) -> list[DecodedPayload]:
        """Validate one contributor's payloads; raise WireError naming what is wrong.

        Every payload must be signed by `replica` (when an opener is set) and name it, the round and the
        shard in its header. An anchor contributes every shard, a chain stage only its own layers'; a
        replica holding a slice is given only the shards it holds."""
        if not payloads or not set(payloads) <= set(self.shards):
            raise WireError(
                "shards", f"expected a non-empty subset of {sorted(self.shards)}, got {sorted(payloads)}"
            )
        decoded = []
        for shard, data in payloads.items():
            body = data
            if self.opener is not None:
                author, body = self.opener(data)
                if author != replica:
                    raise WireError("author", f"shard {shard} is signed by {author[-8:]}, not {replica[-8:]}")
            message = decode_payload(body, self.sparse_specs[shard])
            if message.replica != replica or message.round != round_ or message.shard != shard:
                raise WireError("header", f"payload is ({message.replica}, {message.round}, {message.shard})")
            decoded.append(message)
        return decoded

    def apply(self, round_: int, contributions: Sequence[tuple[str, dict[str, bytes]]]) -> None:
        """θ ← θ − α·aggregate over the sealed contributions (in the given, sealed order): all or nothing.

        WireError for an invalid payload, ApplyError for an aggregate that would not be finite."""
        decoded = [(replica, self.decode_contribution(replica, round_, p)) for replica, p in contributions]
        self.apply_decoded(round_, decoded)

    def apply_decoded(self, round_: int, contributions: Sequence[tuple[str, list[DecodedPayload]]]) -> None:
        """`apply` for contributions already validated by `decode_contribution` (the sealer's)."""
        self.commit(self.prepare(round_, contributions))

    def prepare(
        self, round_: int, contributions: Sequence[tuple[str, list[DecodedPayload]]]
    ) -> PreparedRound:
        """Aggregate every shard of the round and check the step before any parameter changes."""
        if round_ != self.params_round + 1:
            raise ValueError(f"round {round_} does not follow the applied round {self.params_round}")
        decoded = dict(contributions)
        delta: dict[str, torch.Tensor] = {}
        for shard, spec in self.sparse_specs.items():
            updates = [
                (replica, message.sparse)
                for replica, messages in decoded.items()
                for message in messages
                if message.shard == shard
            ]
            if updates:
                delta.update(aggregate_sparse(updates, dict(spec.shapes), rule=self.config.outer.aggregation))
        o = self.config.outer
        unsafe = unsafe_outer_step({n: self.params[n] for n in delta}, delta, o.lr, o.weight_decay)
        if unsafe is not None:
            raise ApplyError(round_, unsafe, [replica for replica, _ in contributions])
        return PreparedRound(round_, delta)

    def commit(self, prepared: PreparedRound) -> None:
        """Step θ by a prepared round (checked: nothing here can fail half-way)."""
        if prepared.round != self.params_round + 1:
            raise ValueError(f"round {prepared.round} does not follow the applied round {self.params_round}")
        o = self.config.outer
        params = {n: self.params[n] for n in prepared.delta}
        outer_sgd_step(params, prepared.delta, lr=o.lr, weight_decay=o.weight_decay)
        self.params_round = prepared.round
        self.changed()

    def changed(self) -> None:
        """θ was written: the cached digests are stale (everything that writes `params` calls this)."""
        self._digests = None

    def digests(self) -> dict[str, str]:
        """Layer digests of the shards held (cached until θ changes: hashing θ costs as much as a step)."""
        if self._digests is None:
            self._digests = layer_digests(self.params)
        return dict(self._digests)

    def state_payload(self, shard: str) -> bytes:
        """This shard of θ as a dense fp32 message, for a peer catching up."""
        codec = DenseCodec("fp32")
        names = self.shards[shard]
        tensors = {n: codec.compress(self.params[n]) for n in names}
        return encode_payload(SyncPayload("global", max(self.params_round, 0), shard, "fp32", tensors))

    def load_state(
        self, params_round: int, payloads: dict[str, bytes], expect_digests: dict[str, str] | None = None
    ) -> None:
        """Replace θ with validated dense shards (all of them, or nothing changes). With `expect_digests`
        (what the source publishes for that round) the decoded layers must match them first."""
        if set(payloads) != set(self.shards):
            raise WireError("shards", f"expected {sorted(self.shards)}, got {sorted(payloads)}")
        decoded = {shard: decode_payload(data, self.dense_specs[shard]) for shard, data in payloads.items()}
        incoming = {name: tensor for message in decoded.values() for name, tensor in message.dense.items()}
        if expect_digests is not None:
            expected = {shard: expect_digests.get(shard) for shard in self.shards}  # the shards we hold
            if layer_digests(incoming) != expected:
                raise WireError(
                    "digests", f"the state for round {params_round} does not match its published digests"
                )
        with torch.no_grad():
            for name, tensor in incoming.items():
                self.params[name].copy_(tensor)
        self.params_round = params_round
        self.changed()


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
