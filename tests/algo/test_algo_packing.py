"""Round trips and input checks for the 12-bit / 2-bit packers (docs/sync.md, "Compression" wire layout)."""

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from hetnode.algo.packing import pack_uint2, pack_uint12, unpack_uint2, unpack_uint12


@given(st.lists(st.integers(0, 4095), max_size=300))
def test_uint12_round_trip(values: list[int]) -> None:
    data = pack_uint12(np.array(values, dtype=np.int64))
    assert len(data) == (len(values) + 1) // 2 * 3
    assert unpack_uint12(data, len(values)).tolist() == values


@given(st.lists(st.integers(0, 3), max_size=300))
def test_uint2_round_trip(values: list[int]) -> None:
    data = pack_uint2(np.array(values, dtype=np.int64))
    assert len(data) == (len(values) + 3) // 4
    assert unpack_uint2(data, len(values)).tolist() == values


def test_known_layouts() -> None:
    # a | b << 12 as 3 little-endian bytes; first 2-bit code in the low bits.
    assert pack_uint12([0xABC, 0x123]) == bytes([0xBC, 0x3A, 0x12])
    assert pack_uint12([0xFFF]) == bytes([0xFF, 0x0F, 0x00])
    assert pack_uint2([1, 2, 3, 0, 3]) == bytes([0b00111001, 0b00000011])


def test_accepts_tensors_and_empty() -> None:
    assert unpack_uint12(pack_uint12(torch.tensor([5, 4095, 0])), 3).tolist() == [5, 4095, 0]
    assert pack_uint12([]) == b"" and unpack_uint12(b"", 0).size == 0
    assert pack_uint2(torch.tensor([], dtype=torch.int64)) == b"" and unpack_uint2(b"", 0).size == 0
    assert unpack_uint12(pack_uint12(np.arange(4096, dtype=np.uint16)), 4096).tolist() == list(range(4096))


@pytest.mark.parametrize("bad", [[-1], [4096], [0, 5000]])
def test_uint12_rejects_out_of_range(bad: list[int]) -> None:
    with pytest.raises(ValueError):
        pack_uint12(bad)


@pytest.mark.parametrize("bad", [[-1], [4], [0, 1, 2, 7]])
def test_uint2_rejects_out_of_range(bad: list[int]) -> None:
    with pytest.raises(ValueError):
        pack_uint2(bad)


def test_rejects_non_integers() -> None:
    with pytest.raises(ValueError):
        pack_uint12(np.array([1.0, 2.0]))
    with pytest.raises(ValueError):
        pack_uint2(np.array([0.5]))


@given(st.integers(0, 200), st.integers(-4, 4))
def test_rejects_wrong_lengths(count: int, off: int) -> None:
    data12 = pack_uint12(np.zeros(count, dtype=np.int64))
    data2 = pack_uint2(np.zeros(count, dtype=np.int64))
    if off == 0:
        return
    if len(data12) + off >= 0:
        with pytest.raises(ValueError):
            unpack_uint12(b"\0" * (len(data12) + off), count)
    if len(data2) + off >= 0:
        with pytest.raises(ValueError):
            unpack_uint2(b"\0" * (len(data2) + off), count)


def test_rejects_count_mismatch_and_dirty_padding() -> None:
    with pytest.raises(ValueError):
        unpack_uint12(pack_uint12([1, 2, 3, 4]), 5)  # 6 bytes, 5 values need 9
    with pytest.raises(ValueError):
        unpack_uint12(pack_uint12([1, 2]), 1)  # padding slot holds 2
    with pytest.raises(ValueError):
        unpack_uint2(pack_uint2([1, 2]), 1)
    with pytest.raises(ValueError):
        unpack_uint2(b"", -1)
