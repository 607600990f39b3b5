"""Real sizes for `hetnode bench scale`: sync payloads per shard from the project's codec and encoders, and
the seal a replica reads, for any config without building its model (docs/scale.md)."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import msgpack
import torch

from hetnode.algo.sparseloco import CompressedTensor, SparseLoCoCodec
from hetnode.config import Config, ModelConfig
from hetnode.lab.scale.control import RECORD_OVERHEAD_BYTES
from hetnode.model.layers import Block
from hetnode.planning.layer_split import split_layers
from hetnode.wire.signed_payload import SignedEnvelope, encode_envelope
from hetnode.wire.sync_payload import SyncPayload, encode_payload

# What a real payload carries besides the codec's bytes: a libp2p RSA peer id ("Qm…", 46 characters), a
# round number past 255, and the envelope's OpenSSH RSA-2048 key and base64 signature (measured: 380, 344).
PEER_ID_CHARS = 46
ROUND = 1000
KEY_BYTES = 380
SIGNATURE_BYTES = 344
DENSE_AGGREGATE_BYTES_PER_PARAM = 2  # bf16: what every replica applies in `tiles` mode (docs/scale.md)


def shard_shapes(model: ModelConfig) -> dict[str, dict[str, tuple[int, ...]]]:
    """{shard: {parameter: shape}} of the whole decoder, as `hetnode.model.shards.shard_names` groups a
    built model's parameters, derived from the config alone (one block built on the meta device)."""
    with torch.device("meta"):
        block = {name: tuple(p.shape) for name, p in Block(model).named_parameters()}
    d, v = model.d_model, model.vocab_size
    shapes: dict[str, dict[str, tuple[int, ...]]] = {"embed": {"embed.weight": (v, d)}}
    for i in range(model.n_layers):
        shapes[str(i)] = {f"blocks.{i}.{name}": shape for name, shape in block.items()}
    shapes["head"] = {"norm.weight": (d,)}
    if not model.tie_embeddings:
        shapes["head"]["head.weight"] = (v, d)
    return shapes


def signed_payload_bytes(shard: str, shapes: Mapping[str, tuple[int, ...]], topk: int, tile: int) -> int:
    """Bytes of one signed sync payload of `shard`: the real message and envelope encoders run on
    buffers of the sizes the codec fixes (a payload's size depends on the shapes, never on the values)."""
    codec = SparseLoCoCodec(topk, tile)
    tensors = {}
    for name, shape in shapes.items():
        n = codec.grid(shape).total_selected
        indices, codes = bytes(math.ceil(n / 2) * 3), bytes(math.ceil(n / 4))
        tensors[name] = CompressedTensor(tuple(shape), indices, codes, 0.0, (0.0, 0.0, 0.0, 0.0))
    body = encode_payload(SyncPayload("Q" * PEER_ID_CHARS, ROUND, shard, "sparseloco", tensors))
    return len(encode_envelope(SignedEnvelope(bytes(KEY_BYTES), bytes(SIGNATURE_BYTES), body)))


@dataclass(frozen=True)
class PayloadSizes:
    """One config's sync payloads: bytes and parameters per shard, and which shards each stage holds."""

    config: str
    shard_bytes: dict[str, int]
    shard_params: dict[str, int]
    stage_shards: tuple[tuple[str, ...], ...]  # per stage index of a chain

    @property
    def payload_bytes(self) -> int:
        """p: one replica's payload, all shards."""
        return sum(self.shard_bytes.values())

    @property
    def parameters(self) -> int:
        return sum(self.shard_params.values())

    def stage_bytes(self, stage: int) -> int:
        return sum(self.shard_bytes[s] for s in self.stage_shards[stage])

    def stage_params(self, stage: int) -> int:
        return sum(self.shard_params[s] for s in self.stage_shards[stage])


def payload_sizes(config: Config) -> PayloadSizes:
    shapes = shard_shapes(config.model)
    o = config.outer
    nbytes = {s: signed_payload_bytes(s, named, o.topk, o.tile) for s, named in shapes.items()}
    params = {s: sum(math.prod(shape) for shape in named.values()) for s, named in shapes.items()}
    # equal members: layers split evenly (the planner splits by compute)
    splits = split_layers(config.model.n_layers, [1.0] * config.pipeline.stages)
    stages = stage_shards(splits, config.model.tie_embeddings)
    return PayloadSizes(config.run.name, nbytes, params, stages)


def stage_shards(splits: Sequence[Sequence[int]], tie_embeddings: bool) -> tuple[tuple[str, ...], ...]:
    """The shards each stage of a chain holds, given its layers: the embedding rides on the first stage,
    the final norm and head on the last, as `ModelPart.of_stage` holds them."""
    stages = []
    for i, layers in enumerate(splits):
        held = [str(layer) for layer in layers]
        if i == 0 or (i == len(splits) - 1 and tie_embeddings):
            held.insert(0, "embed")
        if i == len(splits) - 1:
            held.append("head")
        stages.append(tuple(held))
    return tuple(stages)


def seal_bytes(sizes: PayloadSizes, anchors: int, chains: int) -> int:
    """The seal a replica reads: one entry per contributing peer (an anchor lists every shard, a stage its
    slice's) with each shard's sha256, as the sealer writes it, plus the DHT record's owner key, signature
    and expiry."""
    entries = [list(sizes.shard_bytes)] * anchors + [list(s) for s in sizes.stage_shards] * chains
    contributions = [
        {"peer": "Q" * PEER_ID_CHARS, "shards": {s: "0" * 64 for s in shards}, "tokens": 2**20}
        for shards in entries
    ]
    record = {
        "round": ROUND,
        "contributions": contributions,
        "excluded": {},
        "sealed_at": 0.5,
        "prev": "0" * 64,
    }
    return len(msgpack.packb(record, use_bin_type=True)) + RECORD_OVERHEAD_BYTES


def crossover(sizes: PayloadSizes) -> dict:
    """R* per part held: the smallest R at which the dense aggregate of the part (2 bytes/param) weighs no
    more than the R − 1 sparse payloads a replica holding it downloads today."""

    def r_star(params: int, payload: int) -> int:
        return 1 + math.ceil(DENSE_AGGREGATE_BYTES_PER_PARAM * params / payload)

    return {
        "anchor": r_star(sizes.parameters, sizes.payload_bytes),
        "stages": [
            r_star(sizes.stage_params(s), sizes.stage_bytes(s)) for s in range(len(sizes.stage_shards))
        ],
        "bytes_per_param": sizes.payload_bytes / sizes.parameters,
    }
