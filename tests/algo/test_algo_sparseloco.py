"""SparseLoCo codec and error feedback (docs/sync.md)."""

import dataclasses
import math

import numpy as np
import pytest
import torch

from hetnode.algo.packing import pack_uint12, unpack_uint2, unpack_uint12
from hetnode.algo.sparseloco import (
    DenseCodec,
    ErrorFeedback,
    SparseLoCoCodec,
    pseudo_gradient,
    quantize_2bit,
)


@pytest.mark.parametrize("shape", [(128, 192), (96, 40), (257,), (384,), (3, 5, 7)])
def test_keeps_k_largest_per_tile(shape: tuple[int, ...]) -> None:
    torch.manual_seed(0)
    codec = SparseLoCoCodec()
    t = torch.randn(shape)
    grid = codec.grid(shape)
    ct = codec.compress(t)
    pos = unpack_uint12(ct.indices, grid.total_selected).reshape(grid.num_tiles, grid.k)
    assert np.all(np.diff(pos, axis=1) > 0)
    tiles = grid.to_tiles(t).abs().numpy()
    expected = np.sort(np.argsort(-tiles, axis=1, kind="stable")[:, : grid.k], axis=1)
    assert np.array_equal(pos, expected)
    assert len(ct.codes) == (grid.total_selected + 3) // 4


def test_decompress_places_dequantised_values() -> None:
    torch.manual_seed(1)
    codec = SparseLoCoCodec()
    t = torch.randn(128, 192)
    ct = codec.compress(t)
    dense = codec.decompress(ct)
    assert dense.shape == t.shape and dense.dtype == torch.float32
    flat, vals = codec.sparse(ct)
    grid = codec.grid(t.shape)
    assert flat.numel() == grid.total_selected == torch.unique(flat).numel()
    codes = torch.from_numpy(unpack_uint2(ct.codes, grid.total_selected))
    table = torch.tensor(ct.table, dtype=torch.float32)
    assert torch.equal(vals, table[codes] + torch.tensor(ct.shift, dtype=torch.float32))
    assert torch.equal(dense.reshape(-1)[flat], vals)
    mask = torch.ones(t.numel(), dtype=torch.bool)
    mask[flat] = False
    assert torch.count_nonzero(dense.reshape(-1)[mask]) == 0
    # selected entries are the largest in |t|, so sign is preserved for the big ones
    big = t.reshape(-1)[flat].abs() > 3.0
    assert torch.all(torch.sign(vals[big]) == torch.sign(t.reshape(-1)[flat][big]))


def test_quantisation_table_is_bin_means() -> None:
    vals = torch.tensor([-4.0, -2.0, -1.0, 0.0, 0.0, 1.0, 2.0, 4.0])
    codes, shift, table = quantize_2bit(vals)
    scale = 1.5 * math.sqrt(42 / 8)
    assert shift == 0.0
    assert codes.tolist() == [1, 1, 2, 2, 2, 2, 3, 3]
    assert table[1:] == (-3.0, 0.0, 3.0)
    assert table[0] == pytest.approx(-2 * scale, rel=1e-6)  # empty bin: its centre
    for x in (shift, *table):
        assert float(np.float32(x)) == x

    codec = SparseLoCoCodec(topk=4096)  # keep all 8 of the 8-element chunk
    ct = codec.compress(vals + 10.0)
    assert ct.shift == 10.0 and ct.table[1:] == (-3.0, 0.0, 3.0)
    assert codec.decompress(ct).tolist() == [7.0, 7.0, 10.0, 10.0, 10.0, 10.0, 13.0, 13.0]


def test_quantisation_clamps_outliers() -> None:
    vals = torch.tensor([0.0] * 20 + [100.0])
    codes, shift, table = quantize_2bit(vals)
    assert codes.max() <= 3 and codes.min() >= 0
    assert table[3] == pytest.approx(100.0 - shift)


@pytest.mark.parametrize("value", [0.0, 3.0, 0.1, -7.3e-5])
def test_constant_tensors_have_no_nan(value: float) -> None:
    codec = SparseLoCoCodec()
    for shape in ((64, 128), (257,), ()):
        t = torch.full(shape, value)
        ct = codec.compress(t)
        dense = codec.decompress(ct)
        assert torch.isfinite(dense).all()
        flat, vals = codec.sparse(ct)
        assert torch.allclose(vals, torch.full_like(vals, value), rtol=1e-6, atol=0)
    assert codec.compress(torch.zeros(64, 64)).table == (0.0, 0.0, 0.0, 0.0)


def test_rejects_bad_input_and_payloads() -> None:
    codec = SparseLoCoCodec()
    t = torch.randn(64, 64)
    t[3, 3] = float("nan")
    with pytest.raises(ValueError):
        codec.compress(t)
    ct = codec.compress(torch.randn(64, 64))
    with pytest.raises(ValueError):
        codec.decompress(dataclasses.replace(ct, indices=ct.indices[:-3]))
    with pytest.raises(ValueError):
        codec.decompress(dataclasses.replace(ct, codes=ct.codes + b"\0"))
    with pytest.raises(ValueError):
        codec.decompress(dataclasses.replace(ct, shift=float("inf")))
    with pytest.raises(ValueError):
        codec.decompress(dataclasses.replace(ct, indices=pack_uint12([7] * 64)))  # not ascending
    with pytest.raises(ValueError):
        codec.decompress(dataclasses.replace(ct, shape=(64, 128)))
    small = SparseLoCoCodec(topk=4096).compress(torch.randn(8))
    with pytest.raises(ValueError):  # position 8 in an 8-element chunk
        SparseLoCoCodec(topk=4096).decompress(dataclasses.replace(small, indices=pack_uint12(range(1, 9))))


@pytest.mark.parametrize("shape", [(128, 192), (96, 40), (257,), (3, 5, 7)])
def test_the_senders_dense_copy_is_bit_for_bit_what_receivers_decompress(shape: tuple[int, ...]) -> None:
    torch.manual_seed(3)
    codec = SparseLoCoCodec()
    t = torch.randn(shape) * 1e-2
    compressed, dense = codec.compress_dense(t)
    assert compressed == codec.compress(t)
    assert torch.equal(dense, codec.decompress(compressed))
    ef, dense_out = ErrorFeedback(codec), {}
    sent = ef.compress({"t": t}, dense_out)
    assert torch.equal(dense_out["t"], codec.decompress(sent["t"]))


def test_error_feedback_conserves_mass() -> None:
    torch.manual_seed(2)
    beta = 0.95
    ef = ErrorFeedback(SparseLoCoCodec(), beta=beta)
    shapes = {"w": (128, 192), "b": (257,), "n": (384,)}
    old = {n: torch.zeros(s) for n, s in shapes.items()}
    for _ in range(5):
        deltas = {n: torch.randn(s) * 1e-2 for n, s in shapes.items()}
        cts = ef.compress(deltas)
        for n in shapes:
            expected = beta * old[n] + deltas[n]
            sent = ef.codec.decompress(cts[n])
            scale = float(expected.abs().max())
            assert torch.allclose(sent + ef.buffers[n], expected, rtol=1e-6, atol=1e-6 * scale)
            assert torch.count_nonzero(sent) <= ef.codec.grid(shapes[n]).total_selected
            old[n] = ef.buffers[n].clone()

    state = ef.state_dict()
    ef2 = ErrorFeedback(SparseLoCoCodec(), beta=0.5)
    ef2.load_state_dict(state)
    assert ef2.beta == beta and all(torch.equal(ef2.buffers[n], ef.buffers[n]) for n in shapes)
    deltas = {n: torch.randn(s) for n, s in shapes.items()}
    assert ef.compress(deltas) == ef2.compress(deltas)
    with pytest.raises(ValueError):
        ef.compress({"w": torch.randn(3, 3)})


def test_dense_codec() -> None:
    t = torch.randn(33, 17)
    fp32 = DenseCodec("fp32")
    dt = fp32.compress(t)
    assert dt.nbytes == 33 * 17 * 4 == fp32.nbytes((33, 17))
    assert torch.equal(fp32.decompress(dt), t)
    bf16 = DenseCodec("bf16")
    db = bf16.compress(t)
    assert db.nbytes == 33 * 17 * 2
    assert torch.equal(bf16.decompress(db), t.to(torch.bfloat16).float())
    with pytest.raises(ValueError):
        bf16.decompress(dataclasses.replace(db, data=db.data[:-1]))
    with pytest.raises(ValueError):
        DenseCodec("fp8")  # type: ignore[arg-type]


def test_pseudo_gradient() -> None:
    g = {"a": torch.ones(3), "b": torch.zeros(2, dtype=torch.bfloat16)}
    loc = {"a": torch.full((3,), 0.25), "b": torch.ones(2, dtype=torch.bfloat16)}
    d = pseudo_gradient(g, loc)
    assert torch.equal(d["a"], torch.full((3,), 0.75)) and torch.equal(d["b"], -torch.ones(2))
    assert d["b"].dtype == torch.float32
    with pytest.raises(ValueError):
        pseudo_gradient(g, {"a": torch.ones(3)})


def test_restoring_an_unsealed_payload_gives_back_the_full_buffer() -> None:
    torch.manual_seed(3)
    ef = ErrorFeedback(SparseLoCoCodec(), beta=0.9)
    ef.compress({"w": torch.randn(64, 128) * 1e-2})
    before = ef.buffers["w"].clone()
    delta = torch.randn(64, 128) * 1e-2
    sent = ef.compress({"w": delta})
    assert not torch.allclose(ef.buffers["w"], 0.9 * before + delta)  # the sent part was taken out
    ef.restore(sent)  # left out of the seal: nothing may be lost
    assert torch.allclose(ef.buffers["w"], 0.9 * before + delta, atol=1e-7)


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), torch.finfo(torch.float32).max])
def test_a_pseudo_gradient_that_is_not_finite_leaves_every_buffer_as_it_was(bad: float) -> None:
    """All or nothing: `w` comes first and is fine, `b` is not (NaN, inf, or too large to quantise):
    neither buffer changes, nothing is written to `dense`, and the next honest round goes on from there."""
    torch.manual_seed(4)
    ef, twin = ErrorFeedback(SparseLoCoCodec(), beta=0.9), ErrorFeedback(SparseLoCoCodec(), beta=0.9)
    first = {"w": torch.randn(64, 128) * 1e-2, "b": torch.randn(257) * 1e-2}
    ef.compress(first)
    twin.compress(first)
    before = {n: b.clone() for n, b in ef.buffers.items()}
    poisoned = {"w": torch.randn(64, 128) * 1e-2, "b": torch.randn(257) * 1e-2}
    poisoned["b"][7] = bad
    dense: dict[str, torch.Tensor] = {}
    with pytest.raises(ValueError):
        ef.compress(poisoned, dense)
    assert all(torch.equal(ef.buffers[n], before[n]) for n in before) and not dense
    honest = {"w": torch.randn(64, 128) * 1e-2, "b": torch.randn(257) * 1e-2}
    assert ef.compress(honest) == twin.compress(honest)
