"""Sync payloads: one msgpack message per (replica, round, shard) carrying compressed pseudo-gradients.

Decoding treats the bytes as hostile: it checks the size before parsing, then the version, the codec,
every tensor name and shape against what the receiver expects, the exact byte counts the tile grid
implies, index ranges and finite quantisation tables, and returns only when *all* tensors are valid,
so a bad payload is never partially applied. Each violation raises `WireError` naming the field.
"""

from __future__ import annotations

import math
import struct
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

import msgpack
import torch

from hetnode.algo.sparseloco import CompressedTensor, DenseCodec, DenseTensor, SparseLoCoCodec
from hetnode.errors import WireError

PAYLOAD_TYPE = "sync"
PAYLOAD_VERSION = 2  # 2: the header names the θ round the payload was trained from (`base`)
MAX_ID_CHARS = 256
ENVELOPE_SLACK_BYTES = 4096  # message header + the signed envelope's key and signature
TENSOR_SLACK_BYTES = 64  # one tensor entry's map keys and length prefixes

CodecName = Literal["sparseloco", "fp32", "bf16"]
SparseValues = tuple[torch.Tensor, torch.Tensor]  # (flat indices, float32 values)


@dataclass(frozen=True)
class ShardSpec:
    """What a receiver expects of one shard's payload: the model's tensors and the run's codec and limits."""

    shard: str
    shapes: Mapping[str, tuple[int, ...]]
    codec: CodecName = "sparseloco"
    topk: int = 64
    tile: int = 64
    max_bytes: int = 64 * 2**20
    # bound on |shift| + max|table| of a sparse tensor (docs/security.md, "Crash the coordinator or a replica
    # with one payload")
    max_value: float = 1000.0

    def max_payload_bytes(self) -> int:
        """The most bytes a valid payload of this shard can weigh, signed envelope included: what a
        fetch of it may reserve (every size is fixed by the shapes and the codec)."""
        total = ENVELOPE_SLACK_BYTES
        for name, shape in self.shapes.items():
            total += TENSOR_SLACK_BYTES + len(name.encode()) + 9 * len(shape)
            if self.codec == "sparseloco":
                n = SparseLoCoCodec(self.topk, self.tile).grid(tuple(shape)).total_selected
                total += math.ceil(n / 2) * 3 + math.ceil(n / 4) + 5 * 9
            else:
                total += math.prod(shape) * (4 if self.codec == "fp32" else 2)
        return min(total, self.max_bytes)


@dataclass(frozen=True)
class SyncPayload:
    """An outgoing payload (what `encode_payload` serialises)."""

    replica: str
    round: int
    shard: str
    codec: CodecName
    tensors: Mapping[str, CompressedTensor | DenseTensor]
    base: int | None = None  # θ after this round was trained from (None: round − 1, the fresh θ)

    @property
    def base_round(self) -> int:
        return self.round - 1 if self.base is None else self.base


@dataclass(frozen=True)
class DecodedPayload:
    """A validated incoming payload, ready to aggregate: sparse (indices, values) or dense tensors."""

    replica: str
    round: int
    shard: str
    codec: CodecName
    sparse: dict[str, SparseValues]
    dense: dict[str, torch.Tensor]
    base: int = -1  # the θ round its author trained from (verifiers check it is round − 1: fresh work)


def encode_payload(payload: SyncPayload) -> bytes:
    tensors = []
    for name, t in payload.tensors.items():
        entry: dict[str, Any] = {"name": name, "shape": list(t.shape)}
        if isinstance(t, CompressedTensor):
            entry.update(idx=t.indices, codes=t.codes, q=[t.shift, *t.table])
        else:
            entry.update(dtype=t.dtype, data=t.data)
        tensors.append(entry)
    message = {
        "type": PAYLOAD_TYPE,
        "v": PAYLOAD_VERSION,
        "replica": payload.replica,
        "round": payload.round,
        "base": payload.base_round,
        "shard": payload.shard,
        "codec": payload.codec,
        "tensors": tensors,
    }
    # float32 is exact for shift/table (the codec computes them in float32) and saves 4 bytes each.
    return msgpack.packb(message, use_bin_type=True, use_single_float=True)


def decode_payload(data: bytes, spec: ShardSpec) -> DecodedPayload:
    """Parse and validate one payload against `spec`; raise `WireError(field, ...)` on any violation."""
    if len(data) > spec.max_bytes:
        raise WireError("size", f"{len(data)} bytes exceeds the limit of {spec.max_bytes}")
    try:
        message = msgpack.unpackb(
            data,
            raw=False,
            strict_map_key=True,
            max_bin_len=spec.max_bytes,
            max_str_len=MAX_ID_CHARS * 4,
            max_array_len=max(16, 4 * len(spec.shapes) + 8),
            max_map_len=16,
        )
    except Exception as exc:  # msgpack raises several types for truncated or malformed input
        raise WireError("msgpack", f"not a valid msgpack message ({type(exc).__name__}: {exc})") from None
    if not isinstance(message, dict):
        raise WireError("message", "must be a map")
    _expect(message, "type", str)
    if message["type"] != PAYLOAD_TYPE:
        raise WireError("type", f"expected {PAYLOAD_TYPE!r}, got {message['type']!r}")
    version = _expect(message, "v", int)
    if version != PAYLOAD_VERSION:
        raise WireError("v", f"unknown payload version {version} (this peer speaks {PAYLOAD_VERSION})")
    replica = _expect(message, "replica", str)
    if not 0 < len(replica) <= MAX_ID_CHARS:
        raise WireError("replica", f"must be 1..{MAX_ID_CHARS} characters")
    round_ = _expect(message, "round", int)
    if round_ < 0:
        raise WireError("round", f"must be >= 0, got {round_}")
    base = _expect(message, "base", int)
    if not -1 <= base < round_:
        raise WireError("base", f"trained from round {base}, which is not before round {round_}")
    if _expect(message, "shard", str) != spec.shard:
        raise WireError("shard", f"expected {spec.shard!r}, got {message['shard']!r}")
    if _expect(message, "codec", str) != spec.codec:
        raise WireError("codec", f"expected {spec.codec!r}, got {message['codec']!r}")
    entries = _expect(message, "tensors", list)

    seen: set[str] = set()
    sparse: dict[str, SparseValues] = {}
    dense: dict[str, torch.Tensor] = {}
    codec = SparseLoCoCodec(spec.topk, spec.tile) if spec.codec == "sparseloco" else DenseCodec(spec.codec)
    for i, entry in enumerate(entries):
        where = f"tensors[{i}]"
        if not isinstance(entry, dict):
            raise WireError(where, "must be a map")
        name = _expect(entry, "name", str, where)
        where = f"tensors[{name}]"
        if name not in spec.shapes:
            raise WireError(f"{where}.name", f"not a tensor of shard {spec.shard!r}")
        if name in seen:
            raise WireError(f"{where}.name", "appears twice")
        seen.add(name)
        shape = tuple(_expect(entry, "shape", list, where))
        if shape != tuple(spec.shapes[name]):
            raise WireError(f"{where}.shape", f"expected {tuple(spec.shapes[name])}, got {shape}")
        if spec.codec == "sparseloco":
            sparse[name] = _decode_sparse(entry, shape, codec, where, spec.max_value)
        else:
            dense[name] = _decode_dense(entry, shape, codec, where)
    missing = sorted(set(spec.shapes) - seen)
    if missing:
        raise WireError("tensors", f"missing {len(missing)} tensor(s), e.g. {missing[:3]}")
    return DecodedPayload(replica, round_, spec.shard, spec.codec, sparse, dense, base)


def _as_float32(value: float | int, field: str) -> float:
    """`value` rounded to float32 as the codec will use it; WireError when it is not finite there."""
    try:
        (rounded,) = struct.unpack("<f", struct.pack("<f", float(value)))
    except (OverflowError, struct.error):
        rounded = math.inf
    if not math.isfinite(rounded):
        raise WireError(field, f"{value!r} is not a finite float32")
    return rounded


def _decode_sparse(
    entry: dict, shape: tuple[int, ...], codec: SparseLoCoCodec, where: str, max_value: float
) -> SparseValues:
    grid = codec.grid(shape)
    idx = _expect(entry, "idx", bytes, where)
    codes = _expect(entry, "codes", bytes, where)
    q = _expect(entry, "q", list, where)
    want_idx = math.ceil(grid.total_selected / 2) * 3
    if len(idx) != want_idx:
        raise WireError(
            f"{where}.idx", f"expected {want_idx} bytes for {grid.total_selected} indices, got {len(idx)}"
        )
    want_codes = math.ceil(grid.total_selected / 4)
    if len(codes) != want_codes:
        raise WireError(f"{where}.codes", f"expected {want_codes} bytes, got {len(codes)}")
    if len(q) != 5 or not all(isinstance(x, float | int) and not isinstance(x, bool) for x in q):
        raise WireError(f"{where}.q", "must be 5 numbers (shift + 4-entry table)")
    # Check the values in the dtype they are applied in: a shift finite in float64 can overflow float32.
    shift, *table = (_as_float32(x, f"{where}.q") for x in q)
    bound = abs(shift) + max(abs(t) for t in table)
    if not bound <= max_value:
        raise WireError(
            f"{where}.q", f"|shift| + max|table| = {bound:.3g} exceeds the run's limit {max_value:g}"
        )
    ct = CompressedTensor(shape, idx, codes, shift, (table[0], table[1], table[2], table[3]))
    try:
        return codec.sparse(ct)
    except ValueError as exc:  # out-of-range or unordered indices, bad padding
        raise WireError(f"{where}.idx", str(exc)) from None


def _decode_dense(entry: dict, shape: tuple[int, ...], codec: DenseCodec, where: str) -> torch.Tensor:
    if _expect(entry, "dtype", str, where) != codec.dtype:
        raise WireError(f"{where}.dtype", f"expected {codec.dtype!r}, got {entry['dtype']!r}")
    data = _expect(entry, "data", bytes, where)
    try:
        values = codec.decompress(DenseTensor(shape, codec.dtype, data))
    except ValueError as exc:
        raise WireError(f"{where}.data", str(exc)) from None
    if not bool(torch.isfinite(values).all()):
        raise WireError(f"{where}.data", "contains NaN or Inf")
    return values


def _expect(container: dict, key: str, kind: type, where: str = "") -> Any:
    field = f"{where}.{key}" if where else key
    if key not in container:
        raise WireError(field, "missing")
    value = container[key]
    # bool is an int in Python; a version or round of `true` is malformed.
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise WireError(field, f"expected {kind.__name__}, got {type(value).__name__}")
    if kind is list and key == "shape" and not all(isinstance(x, int) and x >= 0 for x in value):
        raise WireError(field, "must be a list of non-negative integers")
    return value
