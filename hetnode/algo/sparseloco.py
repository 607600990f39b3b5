"""SparseLoCo compression of pseudo-gradients with error feedback (docs/sync.md).

Per tensor: tile-wise top-k by |value| (see `tiling`), then 2-bit quantisation of the kept signed values
with one parameter set per tensor (shift + a 4-entry table of bin means), then bit packing (12-bit positions,
2-bit codes). Error feedback keeps what was not sent and subtracts exactly the dequantised payload that the
receivers will see, so no signal is lost, only delayed (SparseLoCo, arXiv:2508.15706; error feedback as in
EF-SGD, Karimireddy et al. 2019).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal

import numpy as np
import torch

from hetnode.algo.packing import pack_uint2, pack_uint12, unpack_uint2, unpack_uint12
from hetnode.algo.tiling import TileGrid, tile_grid

NUM_BINS = 4
CENTRE_CODE = 2


@dataclass(frozen=True)
class CompressedTensor:
    """One tensor's SparseLoCo payload.

    `indices`: packed 12-bit within-tile positions, tile-major, exactly k per tile, ascending in each tile.
    `codes`: packed 2-bit codes, same order. Dequantised value = float32(shift) + float32(table[code]).
    """

    shape: tuple[int, ...]
    indices: bytes
    codes: bytes
    shift: float
    table: tuple[float, float, float, float]

    @property
    def nbytes(self) -> int:
        """Payload bytes: packed indices + packed codes + 5 float32 (shift and table)."""
        return len(self.indices) + len(self.codes) + 5 * 4


def quantize_2bit(vals: torch.Tensor) -> tuple[torch.Tensor, float, tuple[float, float, float, float]]:
    """2-bit quantisation of a 1-D float32 vector with one parameter set (docs/sync.md, "Compression").

    shift = mean, σ = population std of the centred values, scale = 6σ/4,
    code = clamp(round(c/scale + 2), 0, 3). The table holds the mean centred value of each bin (bin centre
    (b−2)·scale if empty), which is the least-squares reconstruction for the chosen bins. σ = 0 (constant or
    single value) gives scale 1 and a zero table, i.e. every value decodes to the shift.
    Returns (codes int64, shift, table) with float32-exact Python floats.
    """
    vals = vals.detach().reshape(-1).to(torch.float32)
    if vals.numel() == 0:
        raise ValueError("cannot quantise an empty vector")
    shift = vals.mean()
    centred = vals - shift
    sigma = centred.square().mean().sqrt()
    if float(sigma) == 0.0:
        codes = torch.full_like(vals, CENTRE_CODE, dtype=torch.int64)
        return codes, float(shift), (0.0, 0.0, 0.0, 0.0)
    scale = sigma * 6.0 / 4.0
    codes = torch.round(centred / scale + CENTRE_CODE).clamp_(0, NUM_BINS - 1).to(torch.int64)
    sums = torch.zeros(NUM_BINS, dtype=torch.float32, device=vals.device).scatter_add_(0, codes, centred)
    counts = torch.bincount(codes, minlength=NUM_BINS).to(torch.float32)
    centres = (torch.arange(NUM_BINS, dtype=torch.float32, device=vals.device) - CENTRE_CODE) * scale
    table = torch.where(counts > 0, sums / counts.clamp(min=1.0), centres)
    t = table.cpu().tolist()
    return codes, float(shift), (t[0], t[1], t[2], t[3])


def dequantize_2bit(
    codes: torch.Tensor, shift: float, table: tuple[float, ...], device: torch.device | str | None = None
) -> torch.Tensor:
    """float32(shift) + float32(table)[codes], computed the same way by sender and every receiver."""
    table_t = torch.tensor(table, dtype=torch.float32, device=device)
    shift_t = torch.tensor(shift, dtype=torch.float32, device=device)
    return table_t[codes.to(device=table_t.device, dtype=torch.int64)] + shift_t


class SparseLoCoCodec:
    """Tile-wise top-k + 2-bit quantisation codec (docs/sync.md, "Compression"). Stateless; error feedback
    lives outside."""

    def __init__(self, topk: int = 64, tile: int = 64) -> None:
        self.topk = topk
        self.tile = tile
        tile_grid((tile, tile), tile, topk)  # validate the parameters now rather than at first use

    def grid(self, shape: tuple[int, ...]) -> TileGrid:
        return tile_grid(tuple(int(s) for s in shape), self.tile, self.topk)

    def compress(self, t: torch.Tensor) -> CompressedTensor:
        """Keep the k largest-|v| entries of every tile (vectorised over all tiles), quantise, pack."""
        return self.compress_dense(t)[0]

    def compress_dense(self, t: torch.Tensor) -> tuple[CompressedTensor, torch.Tensor]:
        """`compress(t)` and, bit for bit, what `decompress` of it gives, without packing and unpacking it
        again (the sender's own copy: error feedback and the eager guess subtract it every round)."""
        grid = self.grid(tuple(t.shape))
        tiles = grid.to_tiles(t.detach().to(torch.float32))
        _, pos = torch.topk(tiles.abs(), grid.k, dim=1, sorted=False)
        pos, _ = torch.sort(pos, dim=1)
        vals = tiles.gather(1, pos).reshape(-1)
        if not bool(torch.isfinite(vals).all()):
            # topk ranks NaN/inf first, so a non-finite tensor always shows up here.
            raise ValueError(f"non-finite values in tensor of shape {grid.shape}")
        codes, shift, table = quantize_2bit(vals)
        if not all(math.isfinite(x) for x in (shift, *table)):
            # values near float32's maximum overflow σ²: receivers would refuse such a payload
            raise ValueError(f"values in tensor of shape {grid.shape} too large to quantise")
        compressed = CompressedTensor(
            shape=grid.shape,
            indices=pack_uint12(pos.reshape(-1).cpu().numpy()),
            codes=pack_uint2(codes.cpu().numpy()),
            shift=shift,
            table=table,
        )
        sent = dequantize_2bit(codes, shift, table, device=t.device).reshape(grid.num_tiles, grid.k)
        dense = torch.zeros(grid.num_tiles, grid.tile_elems, dtype=torch.float32, device=sent.device)
        dense.scatter_(1, pos.to(sent.device), sent)
        return compressed, grid.from_tiles(dense)

    def _unpack(self, ct: CompressedTensor) -> tuple[TileGrid, torch.Tensor, torch.Tensor]:
        """Validate a (possibly remote) payload; return (grid, positions [num_tiles, k], codes [n*k])."""
        grid = self.grid(ct.shape)
        if len(ct.table) != NUM_BINS:
            raise ValueError(f"table must have {NUM_BINS} entries, got {len(ct.table)}")
        if not all(math.isfinite(x) for x in (ct.shift, *ct.table)):
            raise ValueError("non-finite shift or table")
        pos_np = unpack_uint12(ct.indices, grid.total_selected).reshape(grid.num_tiles, grid.k)
        if pos_np.size and int(pos_np.max()) >= grid.tile_elems:
            raise ValueError(f"tile position ≥ tile size {grid.tile_elems}")
        if grid.k > 1 and not bool(np.all(pos_np[:, 1:] > pos_np[:, :-1])):
            raise ValueError("tile positions must be strictly ascending inside each tile")
        codes = torch.from_numpy(unpack_uint2(ct.codes, grid.total_selected))
        return grid, torch.from_numpy(pos_np), codes

    def decompress(self, ct: CompressedTensor, device: torch.device | str | None = None) -> torch.Tensor:
        """Dense float32 tensor of the original shape: dequantised values at the sent positions, else 0."""
        grid, pos, codes = self._unpack(ct)
        vals = dequantize_2bit(codes, ct.shift, ct.table, device=device).reshape(grid.num_tiles, grid.k)
        tiles = torch.zeros(grid.num_tiles, grid.tile_elems, dtype=torch.float32, device=vals.device)
        tiles.scatter_(1, pos.to(vals.device), vals)
        return grid.from_tiles(tiles)

    def sparse(self, ct: CompressedTensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(flat indices into the flattened tensor, dequantised float32 values); tile-major order."""
        grid, pos, codes = self._unpack(ct)
        return grid.flat_indices(pos), dequantize_2bit(codes, ct.shift, ct.table)


DenseDtype = Literal["fp32", "bf16"]


@dataclass(frozen=True)
class DenseTensor:
    """Uncompressed baseline payload: little-endian fp32 or bf16 bytes, row-major."""

    shape: tuple[int, ...]
    dtype: DenseDtype
    data: bytes

    @property
    def nbytes(self) -> int:
        return len(self.data)


class DenseCodec:
    """Dense fp32/bf16 codec for the DiLoCo baselines (no compression beyond the dtype)."""

    _NP = {"fp32": np.dtype("<f4"), "bf16": np.dtype("<i2")}

    def __init__(self, dtype: DenseDtype = "fp32") -> None:
        if dtype not in self._NP:
            raise ValueError(f"dtype must be 'fp32' or 'bf16', got {dtype!r}")
        self.dtype: DenseDtype = dtype

    def compress(self, t: torch.Tensor) -> DenseTensor:
        t = t.detach().cpu().contiguous()
        if self.dtype == "fp32":
            arr = t.to(torch.float32).numpy()
        else:
            arr = t.to(torch.bfloat16).view(torch.int16).numpy()
        return DenseTensor(tuple(t.shape), self.dtype, arr.astype(self._NP[self.dtype], copy=False).tobytes())

    def decompress(self, dt: DenseTensor, device: torch.device | str | None = None) -> torch.Tensor:
        """Dense float32 tensor of the original shape."""
        if dt.dtype not in self._NP:
            raise ValueError(f"unknown dense dtype {dt.dtype!r}")
        np_dtype = self._NP[dt.dtype]
        numel = math.prod(dt.shape)
        if len(dt.data) != numel * np_dtype.itemsize:
            raise ValueError(f"dense payload: expected {numel * np_dtype.itemsize} bytes, got {len(dt.data)}")
        arr = np.frombuffer(dt.data, dtype=np_dtype).astype(np_dtype.newbyteorder("="))
        t = torch.from_numpy(arr)
        if dt.dtype == "bf16":
            t = t.view(torch.bfloat16)
        return t.to(device=device, dtype=torch.float32).reshape(dt.shape)

    def nbytes(self, shape: tuple[int, ...]) -> int:
        """Payload size for a tensor of `shape`, without compressing it."""
        return math.prod(shape) * self._NP[self.dtype].itemsize


class ErrorFeedback:
    """Per-tensor error-feedback buffers around a SparseLoCo codec (docs/sync.md, "One round").

    e ← β·e + Δ; send ct = compress(e); e ← e − decompress(ct). Subtracting the dequantised payload (not the
    pre-quantisation top-k) keeps sent + residual equal to β·e + Δ up to float32 rounding.
    """

    def __init__(self, codec: SparseLoCoCodec, beta: float = 0.95) -> None:
        self.codec = codec
        self.beta = beta
        self.buffers: dict[str, torch.Tensor] = {}

    def compress(
        self, pseudo_grads: dict[str, torch.Tensor], dense: dict[str, torch.Tensor] | None = None
    ) -> dict[str, CompressedTensor]:
        """The payload of `pseudo_grads` with error feedback; `dense`, if given, gets each tensor's payload
        as its receivers decompress it.

        All or nothing: every new buffer is computed aside and checked before any replaces its old one, so
        a ValueError (a Δ that is not finite, or overflows) leaves the error feedback as it was."""
        out: dict[str, CompressedTensor] = {}
        staged: dict[str, torch.Tensor] = {}
        sent: dict[str, torch.Tensor] = {}
        for name, delta in pseudo_grads.items():
            out[name], sent[name], staged[name] = self._accumulate(name, delta)
        self.buffers.update(staged)
        if dense is not None:
            dense.update(sent)
        return out

    def _accumulate(
        self, name: str, delta: torch.Tensor
    ) -> tuple[CompressedTensor, torch.Tensor, torch.Tensor]:
        """(payload, its dense copy, the new buffer) of β·e + Δ, out of place: the buffer is not touched."""
        delta = delta.detach().to(torch.float32)
        buf = self.buffers.get(name)
        if buf is None:
            acc = delta.clone()
        elif buf.shape != delta.shape:
            raise ValueError(f"{name}: shape {tuple(delta.shape)} != buffer shape {tuple(buf.shape)}")
        else:
            acc = buf * self.beta + delta.to(buf.device)  # the rounding of the in-place mul_ then add_
        ct, sent = self.codec.compress_dense(acc)  # refuses non-finite values
        acc.sub_(sent)
        if not bool(torch.isfinite(acc).all()):
            raise ValueError(f"{name}: the error-feedback buffer would not be finite")
        return ct, sent, acc

    def restore(self, sent: dict[str, CompressedTensor]) -> None:
        """Undo the subtraction of a payload that was never applied (e.g. left out of a sealed round)."""
        for name, ct in sent.items():
            buf = self.buffers[name]
            buf.add_(self.codec.decompress(ct, device=buf.device))

    def state_dict(self) -> dict[str, object]:
        return {"beta": self.beta, "buffers": {n: b.detach().clone() for n, b in self.buffers.items()}}

    def load_state_dict(self, state: dict[str, object]) -> None:
        buffers = state["buffers"]
        if not isinstance(buffers, dict):
            raise ValueError("error-feedback state: 'buffers' must be a dict")
        self.beta = float(state["beta"])  # type: ignore[arg-type]
        self.buffers = {str(n): torch.as_tensor(b, dtype=torch.float32).clone() for n, b in buffers.items()}


def pseudo_gradient(
    global_params: dict[str, torch.Tensor], local_params: dict[str, torch.Tensor]
) -> dict[str, torch.Tensor]:
    """Δ = θ_global − θ_local in float32 (docs/sync.md, "One round"): the direction the inner steps moved,
    sign-flipped."""
    if global_params.keys() != local_params.keys():
        missing = sorted(set(global_params) ^ set(local_params))
        raise ValueError(f"global and local parameters differ in names: {missing}")
    return {
        name: g.detach().to(torch.float32)
        - local_params[name].detach().to(device=g.device, dtype=torch.float32)
        for name, g in global_params.items()
    }


# a leaving chain stage hands its error feedback to its successor (`hetnode.daemon.feedback_handoff`). An
# honest one is a residual of its rounds' Δ (at most their norm / (1 − β)): measured in the spare test
# (tiny, a dozen rounds in) at 0.53–0.58 of its slice of θ's norm. One more than 2× that slice is not
# taken: sent out over many rounds, it would be screened out by the verifier
MAX_FEEDBACK_RATIO = 2.0


def tensors_norm(tensors: Mapping[str, torch.Tensor]) -> float:
    return math.sqrt(sum(float(t.double().pow(2).sum()) for t in tensors.values()))


def feedback_refusal(feedback: Mapping[str, torch.Tensor], theta: Mapping[str, torch.Tensor]) -> str | None:
    """Why a predecessor's (decoded, finite) feedback is not taken (None: taken): it must cover exactly
    the tensors of our stage, and its norm be at most MAX_FEEDBACK_RATIO of our slice of θ's. A larger one
    would be sent out over many rounds as oversized payloads, which the verifier screens out."""
    if set(feedback) != set(theta):
        missing, extra = sorted(set(theta) - set(feedback)), sorted(set(feedback) - set(theta))
        return f"not our stage's tensors (missing {missing[:3]}, extra {extra[:3]})"
    norm, bound = tensors_norm(feedback), MAX_FEEDBACK_RATIO * tensors_norm(theta)
    if not norm <= bound:
        return f"norm {norm:.4g} is more than {MAX_FEEDBACK_RATIO:g} of our slice of θ's ({bound:.4g})"
    return None
