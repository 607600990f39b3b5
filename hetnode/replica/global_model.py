"""θ as every replica (and the coordinator) holds it: the one way it changes, sealed rounds applied all or
nothing, its layer digests and its state for peers catching up. Replica math shared by the daemon, the
coordinator and the benchmarks; no networking here (payload signatures are checked by the `opener` the
caller passes).

`GlobalModel.apply` decodes *all* sealed payloads first (each validated against the shard's spec and checked
to belong to the sealed round and replica), and only then aggregates in the sealed order and steps, so a bad
payload never leaves θ half-updated.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass

import torch

from hetnode.algo.aggregate import aggregate_sparse, outer_sgd_step, unsafe_outer_step
from hetnode.algo.sparseloco import DenseCodec
from hetnode.algo.subspace import frozen_embedding
from hetnode.config import Config
from hetnode.errors import HetnodeError, WireError
from hetnode.model.decoder import DecoderStage
from hetnode.model.shards import ModelPart, layer_digests, shard_names
from hetnode.wire.sync_payload import DecodedPayload, ShardSpec, SyncPayload, decode_payload, encode_payload

Params = dict[str, torch.Tensor]
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
        # a stage that tracks the embedding builds it as a first stage would (same seeded values)
        model = DecoderStage(config.model, p.layers, p.first or p.embed, p.last, seed=config.run.seed)
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

    def apply(
        self,
        round_: int,
        contributions: Sequence[tuple[str, dict[str, bytes]]],
        weights: Mapping[str, int] | None = None,
    ) -> None:
        """θ ← θ − α·aggregate over the sealed contributions (in the given, sealed order), each with the
        seal's weight (None: 1 each): all or nothing.

        WireError for an invalid payload, ApplyError for an aggregate that would not be finite."""
        decoded = [(replica, self.decode_contribution(replica, round_, p)) for replica, p in contributions]
        self.apply_decoded(round_, decoded, weights)

    def apply_decoded(
        self,
        round_: int,
        contributions: Sequence[tuple[str, list[DecodedPayload]]],
        weights: Mapping[str, int] | None = None,
    ) -> None:
        """`apply` for contributions already validated by `decode_contribution` (the sealer's)."""
        self.commit(self.prepare(round_, contributions, weights))

    def prepare(
        self,
        round_: int,
        contributions: Sequence[tuple[str, list[DecodedPayload]]],
        weights: Mapping[str, int] | None = None,
    ) -> PreparedRound:
        """Aggregate every shard of the round and check the step before any parameter changes. `weights`:
        each contributor's weight in the aggregate, from the seal (None: 1 each)."""
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
                rule = self.config.outer.aggregation
                delta.update(aggregate_sparse(updates, dict(spec.shapes), rule=rule, weights=weights))
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
