"""Sync payloads round-trip, and decoding rejects every malformed field with the right error."""

import msgpack
import pytest
import torch

from hetnode.algo.sparseloco import DenseCodec, SparseLoCoCodec
from hetnode.errors import WireError
from hetnode.wire.sync_payload import (
    PAYLOAD_VERSION,
    ShardSpec,
    SyncPayload,
    decode_payload,
    encode_payload,
)

SHAPES = {
    "blocks.0.attn.wq.weight": (128, 128),
    "blocks.0.mlp.w_down.weight": (128, 192),
    "blocks.0.attn_norm.weight": (128,),
}
SPEC = ShardSpec("0", SHAPES, "sparseloco", topk=64, tile=64, max_bytes=1 << 20)


def _tensors(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {n: torch.randn(s, generator=g) for n, s in SHAPES.items()}


def _payload_bytes(**overrides) -> bytes:
    codec = SparseLoCoCodec(64, 64)
    payload = SyncPayload(
        "peer-a", 3, "0", "sparseloco", {n: codec.compress(t) for n, t in _tensors().items()}
    )
    message = msgpack.unpackb(encode_payload(payload), raw=False)
    for key, value in overrides.items():
        if value is KeyError:
            del message[key]
        else:
            message[key] = value
    return msgpack.packb(message, use_bin_type=True, use_single_float=True)


def _mutate_tensor(index: int, **changes) -> bytes:
    message = msgpack.unpackb(_payload_bytes(), raw=False)
    message["tensors"][index].update(changes)
    return msgpack.packb(message, use_bin_type=True, use_single_float=True)


def test_sparse_round_trip_matches_the_codec():
    codec = SparseLoCoCodec(64, 64)
    tensors = _tensors()
    decoded = decode_payload(_payload_bytes(), SPEC)
    assert (decoded.replica, decoded.round, decoded.shard) == ("peer-a", 3, "0")
    for name, t in tensors.items():
        idx, vals = decoded.sparse[name]
        dense = torch.zeros(t.numel())
        dense[idx] = vals
        assert torch.equal(dense.view(t.shape), codec.decompress(codec.compress(t)))


def test_dense_round_trip_is_exact():
    spec = ShardSpec("0", SHAPES, "fp32", max_bytes=1 << 20)
    tensors = _tensors(1)
    codec = DenseCodec("fp32")
    data = encode_payload(
        SyncPayload("peer-b", 0, "0", "fp32", {n: codec.compress(t) for n, t in tensors.items()})
    )
    decoded = decode_payload(data, spec)
    for name, t in tensors.items():
        assert torch.equal(decoded.dense[name], t)


def test_payload_is_about_146x_smaller_than_fp32():
    shapes = {f"w{i}": (256, 256) for i in range(8)}
    codec = SparseLoCoCodec(64, 64)
    payload = SyncPayload(
        "p", 0, "s", "sparseloco", {n: codec.compress(torch.randn(s)) for n, s in shapes.items()}
    )
    ratio = 8 * 256 * 256 * 4 / len(encode_payload(payload))
    assert 140 <= ratio <= 146.3


@pytest.mark.parametrize(
    ("data_factory", "field"),
    [
        (lambda: _payload_bytes()[:-7], "msgpack"),  # truncated
        (lambda: msgpack.packb([1, 2]), "message"),
        (lambda: b"\x00" * 10, "msgpack"),
        (lambda: _payload_bytes(v=PAYLOAD_VERSION + 1), "v"),
        (lambda: _payload_bytes(v=True), "v"),
        (lambda: _payload_bytes(type="activations"), "type"),
        (lambda: _payload_bytes(codec="fp32"), "codec"),
        (lambda: _payload_bytes(shard="1"), "shard"),
        (lambda: _payload_bytes(round=-1), "round"),
        (lambda: _payload_bytes(replica=""), "replica"),
        (lambda: _payload_bytes(tensors=KeyError), "tensors"),
        (lambda: _mutate_tensor(0, name="blocks.9.attn.wq.weight"), "tensors[blocks.9.attn.wq.weight].name"),
        (lambda: _mutate_tensor(0, shape=[64, 256]), "tensors[blocks.0.attn.wq.weight].shape"),
        (lambda: _mutate_tensor(0, idx=b"\x00" * 9), "tensors[blocks.0.attn.wq.weight].idx"),
        (lambda: _mutate_tensor(0, codes=b""), "tensors[blocks.0.attn.wq.weight].codes"),
        (
            lambda: _mutate_tensor(0, q=[0.0, 1.0, float("nan"), 0.0, 0.0]),
            "tensors[blocks.0.attn.wq.weight].q",
        ),
        (
            lambda: _mutate_tensor(0, q=[0.0, 1.0, 0.0, float("inf"), 0.0]),
            "tensors[blocks.0.attn.wq.weight].q",
        ),
        (lambda: _mutate_tensor(0, idx=b"\xff" * (4 * 64 * 3 // 2)), "tensors[blocks.0.attn.wq.weight].idx"),
    ],
)
def test_decode_rejects_malformed_fields(data_factory, field):
    with pytest.raises(WireError) as info:
        decode_payload(data_factory(), SPEC)
    assert info.value.field == field


def test_missing_and_duplicate_tensors_are_rejected():
    message = msgpack.unpackb(_payload_bytes(), raw=False)
    dropped = dict(message, tensors=message["tensors"][:-1])
    with pytest.raises(WireError, match="missing") as info:
        decode_payload(msgpack.packb(dropped, use_bin_type=True), SPEC)
    assert info.value.field == "tensors"
    doubled = dict(message, tensors=[*message["tensors"], message["tensors"][0]])
    with pytest.raises(WireError, match="twice"):
        decode_payload(msgpack.packb(doubled, use_bin_type=True), SPEC)


def test_oversize_payload_is_rejected_before_parsing():
    data = _payload_bytes()
    small = ShardSpec("0", SHAPES, "sparseloco", max_bytes=len(data) - 1)
    with pytest.raises(WireError) as info:
        decode_payload(data, small)
    assert info.value.field == "size"


def test_dense_payload_with_nan_is_rejected():
    spec = ShardSpec("0", SHAPES, "fp32", max_bytes=1 << 20)
    tensors = _tensors(2)
    tensors["blocks.0.attn_norm.weight"][5] = float("nan")
    codec = DenseCodec("fp32")
    data = encode_payload(
        SyncPayload("p", 0, "0", "fp32", {n: codec.compress(t) for n, t in tensors.items()})
    )
    with pytest.raises(WireError, match="NaN") as info:
        decode_payload(data, spec)
    assert info.value.field == "tensors[blocks.0.attn_norm.weight].data"
