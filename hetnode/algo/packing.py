"""Bit packing for the SparseLoCo payload (docs/sync.md, "Compression"): 12-bit tile positions and 2-bit
quantisation codes.

Layouts (fixed, little-endian, part of the wire format):
- uint12: each pair (a, b) becomes the 24-bit word a | b << 12 stored as 3 little-endian bytes; an odd
  count is padded with one zero index.
- uint2: four codes per byte, the first code in the lowest two bits; the last byte is padded with zero codes.
Unpacking checks the exact byte length and that padding is zero, so every payload has one canonical encoding.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch


def _as_int_array(values: Any, upper: int, what: str) -> np.ndarray:
    """Flatten `values` to int64 and check 0 ≤ v < upper."""
    if isinstance(values, torch.Tensor):
        values = values.detach().cpu().numpy()
    arr = np.asarray(values).reshape(-1)
    if arr.size == 0:
        return arr.astype(np.int64)
    if arr.dtype.kind not in "iu":
        raise ValueError(f"{what} must be integers, got dtype {arr.dtype}")
    arr = arr.astype(np.int64, copy=False)
    lo, hi = int(arr.min()), int(arr.max())
    if lo < 0 or hi >= upper:
        raise ValueError(f"{what} out of range [0, {upper}): min {lo}, max {hi}")
    return arr


def _as_uint8(data: bytes | bytearray | memoryview, expected: int, what: str) -> np.ndarray:
    if len(data) != expected:
        raise ValueError(f"{what}: expected {expected} bytes, got {len(data)}")
    return np.frombuffer(bytes(data), dtype=np.uint8)


def _check_count(count: int) -> None:
    if count < 0:
        raise ValueError(f"count must be ≥ 0, got {count}")


def uint12_nbytes(count: int) -> int:
    """Packed size of `count` 12-bit values: ceil(count/2)·3."""
    return (count + 1) // 2 * 3


def uint2_nbytes(count: int) -> int:
    """Packed size of `count` 2-bit values: ceil(count/4)."""
    return (count + 3) // 4


def pack_uint12(idx: Any) -> bytes:
    """Pack integers in [0, 4096) two per 3 bytes."""
    arr = _as_int_array(idx, 1 << 12, "uint12 values")
    if arr.size % 2:
        arr = np.concatenate([arr, np.zeros(1, dtype=np.int64)])
    pairs = arr.reshape(-1, 2)
    a, b = pairs[:, 0], pairs[:, 1]
    out = np.empty((pairs.shape[0], 3), dtype=np.uint8)
    out[:, 0] = a & 0xFF
    out[:, 1] = (a >> 8) | ((b & 0xF) << 4)
    out[:, 2] = b >> 4
    return out.tobytes()


def unpack_uint12(data: bytes | bytearray | memoryview, count: int) -> np.ndarray:
    """Inverse of `pack_uint12`: `count` int64 values; ValueError on wrong length or non-zero padding."""
    _check_count(count)
    raw = _as_uint8(data, uint12_nbytes(count), "uint12 payload").astype(np.int64).reshape(-1, 3)
    out = np.empty((raw.shape[0], 2), dtype=np.int64)
    out[:, 0] = raw[:, 0] | ((raw[:, 1] & 0xF) << 8)
    out[:, 1] = (raw[:, 1] >> 4) | (raw[:, 2] << 4)
    flat = out.reshape(-1)
    if flat.size > count and flat[count] != 0:
        raise ValueError("uint12 payload: non-zero padding")
    return flat[:count].copy()


def pack_uint2(codes: Any) -> bytes:
    """Pack integers in [0, 4) four per byte."""
    arr = _as_int_array(codes, 4, "uint2 values")
    pad = (-arr.size) % 4
    if pad:
        arr = np.concatenate([arr, np.zeros(pad, dtype=np.int64)])
    quads = arr.reshape(-1, 4)
    packed = quads[:, 0] | (quads[:, 1] << 2) | (quads[:, 2] << 4) | (quads[:, 3] << 6)
    return packed.astype(np.uint8).tobytes()


def unpack_uint2(data: bytes | bytearray | memoryview, count: int) -> np.ndarray:
    """Inverse of `pack_uint2`: `count` int64 values; ValueError on wrong length or non-zero padding."""
    _check_count(count)
    raw = _as_uint8(data, uint2_nbytes(count), "uint2 payload").astype(np.int64)
    shifts = np.array([0, 2, 4, 6], dtype=np.int64)
    flat = ((raw[:, None] >> shifts) & 0x3).reshape(-1)
    if np.any(flat[count:]):
        raise ValueError("uint2 payload: non-zero padding")
    return flat[:count].copy()
