"""Activation frames between chain stages: msgpack maps carrying one tensor plus token ids.

Forward frames (`act`) carry activations or their subspace coefficients with the token ids and
targets; backward frames (`grad`) carry the gradient for the same micro-batch. Once per round, before
its first `act`, the first stage sends a `drift` frame naming the θ round whose embedding gives the round's
T_fix' = T_fix + (T_S − P(T_S)) (docs/chains.md, "Subspace-compressed boundaries"): every stage holds θ's
embedding and builds it itself, so the frame is a few bytes, not V×d.
Decoding checks the size before parsing, then the version, kind, dtype, the exact shape (width = subspace
rank k when compressed, d otherwise), the byte count, token ids < vocab and finite values
bounded in magnitude (`value_bounds`: what a value may be and still keep the receiving stage finite); a
drift frame carries its round, mb 0 and an integer θ round in [−1, round), nothing else (whether the stage
can build T_fix' from it is the stage's rule: `drift_refusal`). Violations raise `WireError(field)`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Literal

import msgpack
import numpy as np
import torch

from hetnode.errors import WireError

FRAME_VERSION = 2  # 2: a drift frame names a θ round instead of carrying V×d floats
# act, grad: a micro-batch down and its gradient up; drift: the θ round of a round's T_fix', before its first
# act; end (paced rounds): after a round's last act, how many micro-batches the round had (its `mb` field)
FrameKind = Literal["act", "grad", "drift", "end"]
# `act` and `grad` frames are bounded from the model's width d. A coordinate of a vector is at most its norm,
# √d·rms, and so is a subspace coefficient (x − T_fix[tok])·U (U orthonormal): bounding the rms of the
# residual stream (of its gradient) by MAX_ACT_RMS (MAX_GRAD_RMS) bounds every value by √d times that.
# Honest maxima on tiny (configs/tiny.toml, 300 steps in SparseLoCo rounds; 2 and 4 stages, compressed bf16
# and dense fp32): |act| ≤ 1.36 (rms ≤ 0.41), |grad| ≤ 0.043 (rms ≤ 5.1e-4); the bounds at d = 128, 1.1e5
# and 1.1e3, leave 8·10⁴ and 2.6·10⁴ times that (the "massive activations" of trained LLMs, thousands in a
# few coordinates, fit too). Below them a receiving stage stays far inside float32 (bf16 has its range): an
# RMSNorm sums d squares of at most 1e8·d; a weight's gradient sums B·T products of a gradient value and a
# normalised input (≤ √d), at most B·T·d·1e2 (1.7e9 for configs/1b.toml).
MAX_ACT_RMS = 1e4  # the residual stream's rms a frame may carry
MAX_GRAD_RMS = 1e2  # the rms of ∂L/∂x (L a mean over B·T tokens) a frame may carry
_DTYPES: dict[str, tuple[torch.dtype, np.dtype]] = {
    "bf16": (torch.bfloat16, np.dtype("<i2")),  # bf16 bits travel as int16
    "fp32": (torch.float32, np.dtype("<f4")),
}
_NAMES = {torch.bfloat16: "bf16", torch.float32: "fp32"}


@dataclass(frozen=True)
class FrameLimits:
    """What a receiving stage accepts: batch shape, width, dtype, vocabulary and size."""

    batch_size: int
    seq_len: int
    width: int  # k when compressed, d otherwise
    dtype: Literal["bf16", "fp32"]
    vocab_size: int
    max_bytes: int = 64 * 2**20
    d_model: int = 0  # the residual width behind compressed frames (0: uncompressed, drift frames refused)
    max_act: float | None = None  # the largest |value| of an act frame (None: `value_bounds` of the width)
    max_grad: float | None = None  # the same for a grad frame

    def value_bound(self, kind: FrameKind) -> float:
        """The largest |value| an `act` or `grad` frame may carry: as set, else from the residual width
        (d: `d_model` when compressed, else `width`)."""
        bound = self.max_act if kind == "act" else self.max_grad
        if bound is not None:
            return bound
        act, grad = value_bounds(self.d_model or self.width)
        return act if kind == "act" else grad


def value_bounds(d_model: int) -> tuple[float, float]:
    """The largest |value| of an `act` and of a `grad` frame of a model `d_model` wide (see MAX_ACT_RMS)."""
    root = math.sqrt(d_model)
    return MAX_ACT_RMS * root, MAX_GRAD_RMS * root


@dataclass(frozen=True)
class DecodedFrame:
    kind: FrameKind
    round: int
    mb: int
    tensor: torch.Tensor  # (B, T, width) in the frame dtype; empty for drift and end
    tokens: torch.Tensor | None
    targets: torch.Tensor | None
    base: int | None = None  # drift: the θ round (−1: the initial θ) whose embedding gives T_fix'


def _tensor_bytes(t: torch.Tensor) -> tuple[str, bytes]:
    name = _NAMES.get(t.dtype)
    if name is None:
        raise ValueError(f"unsupported frame dtype {t.dtype}")
    t = t.detach().cpu().contiguous()
    arr = t.view(torch.int16).numpy() if name == "bf16" else t.numpy()
    return name, arr.astype(_DTYPES[name][1], copy=False).tobytes()


def encode_frame(
    kind: FrameKind,
    round_: int,
    mb: int,
    tensor: torch.Tensor,
    tokens: torch.Tensor | None = None,
    targets: torch.Tensor | None = None,
) -> bytes:
    dtype, data = _tensor_bytes(tensor)
    message: dict[str, Any] = {
        "type": "frame",
        "v": FRAME_VERSION,
        "kind": kind,
        "round": round_,
        "mb": mb,
        "dtype": dtype,
        "shape": list(tensor.shape),
        "data": data,
    }
    if tokens is not None and targets is not None and torch.equal(tokens[:, 1:], targets[:, :-1]):
        # Targets are the inputs shifted by one: send the T+1 window once (≈ 2 bytes per token, not 4).
        message["ids"] = _id_bytes(torch.cat([tokens, targets[:, -1:]], dim=1))
    else:
        if tokens is not None:
            message["tokens"] = _id_bytes(tokens)
        if targets is not None:
            message["targets"] = _id_bytes(targets)
    return msgpack.packb(message, use_bin_type=True)


def encode_round_end(round_: int, count: int) -> bytes:
    """The first stage's word, after round `round_`'s last act frame, that the round had `count`
    micro-batches (paced rounds: a chain trains as many as the budget allows)."""
    message = {"type": "frame", "v": FRAME_VERSION, "kind": "end", "round": round_, "mb": count}
    return msgpack.packb(message, use_bin_type=True)


def encode_drift(round_: int, base: int) -> bytes:
    """The first stage's word, before round `round_`'s first act frame, that the round's T_fix' comes from
    θ's embedding after round `base` (every stage holds it)."""
    message = {"type": "frame", "v": FRAME_VERSION, "kind": "drift", "round": round_, "mb": 0, "base": base}
    return msgpack.packb(message, use_bin_type=True)


def _id_bytes(ids: torch.Tensor) -> bytes:
    return ids.to(torch.int32).cpu().numpy().astype("<u2").tobytes()


def frame_size_limit(limits: FrameLimits, kinds: tuple[FrameKind, ...]) -> int:
    """The largest frame of these kinds a stage reads (drift and end frames are a few bytes)."""
    return limits.max_bytes


def decode_frame(
    data: bytes,
    limits: FrameLimits,
    expect_kind: FrameKind | tuple[FrameKind, ...],
    expect_round: int | None = None,
) -> DecodedFrame:
    kinds = expect_kind if isinstance(expect_kind, tuple) else (expect_kind,)
    max_bytes = frame_size_limit(limits, kinds)
    if len(data) > max_bytes:
        raise WireError("size", f"{len(data)} bytes exceeds the limit of {max_bytes}")
    try:
        message = msgpack.unpackb(data, raw=False, max_bin_len=max_bytes, max_map_len=16, max_array_len=8)
    except Exception as exc:
        raise WireError("msgpack", f"not a valid msgpack message ({type(exc).__name__})") from None
    if not isinstance(message, dict) or message.get("type") != "frame":
        raise WireError("type", "not an activation frame")
    if message.get("v") != FRAME_VERSION:
        version = _shown(message.get("v"))
        raise WireError("v", f"unknown frame version {version} (this peer speaks {FRAME_VERSION})")
    kind = message.get("kind")
    if kind not in kinds:
        raise WireError("kind", f"expected {' or '.join(map(repr, kinds))}, got {_shown(kind)}")
    round_, mb = message.get("round"), message.get("mb")
    for field, value in (("round", round_), ("mb", mb)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise WireError(field, "must be a non-negative integer")
    if expect_round is not None and round_ != expect_round:
        raise WireError("round", f"frame of round {round_}, this stage is in round {expect_round}")
    if kind == "drift":
        return _drift_frame(message, limits, round_)
    if kind == "end":  # the count is checked by the stage, against what it received
        return DecodedFrame("end", round_, mb, torch.empty(0), None, None)
    if message.get("dtype") != limits.dtype:
        raise WireError("dtype", f"expected {limits.dtype!r}, got {_shown(message.get('dtype'))}")
    shape = message.get("shape")
    want = [limits.batch_size, limits.seq_len, limits.width]
    if not isinstance(shape, list) or len(shape) != 3 or shape[2] != limits.width:
        raise WireError("shape", f"expected (B, T, {limits.width}), got {_shown(shape)}")
    if not (0 < shape[0] <= limits.batch_size and 0 < shape[1] <= limits.seq_len):
        raise WireError("shape", f"batch shape {shape[:2]} exceeds {want[:2]}")
    torch_dtype, np_dtype = _DTYPES[limits.dtype]
    payload = message.get("data")
    if not isinstance(payload, bytes) or len(payload) != math.prod(shape) * np_dtype.itemsize:
        raise WireError("data", f"expected {math.prod(shape) * np_dtype.itemsize} bytes")
    array = np.frombuffer(payload, dtype=np_dtype).astype(np_dtype.newbyteorder("="))
    tensor = torch.from_numpy(array).view(torch_dtype).reshape(shape)
    _check_values(tensor, limits.value_bound(kind))
    window = _ids(message, "ids", [shape[0], shape[1] + 1], limits.vocab_size)
    if window is not None:
        tokens, targets = window[:, :-1], window[:, 1:]
    else:
        tokens = _ids(message, "tokens", shape[:2], limits.vocab_size)
        targets = _ids(message, "targets", shape[:2], limits.vocab_size)
    if kind == "act" and (tokens is None or targets is None):
        raise WireError("tokens", "forward frames must carry tokens and targets")
    return DecodedFrame(kind, round_, mb, tensor, tokens, targets)


def _shown(value: object, limit: int = 40) -> str:
    """A peer's value as an error message quotes it: cut short, since the message ends up in a log line."""
    text = repr(value)
    return text if len(text) <= limit else f"{text[:limit]}… ({len(text)} characters)"


def _check_values(tensor: torch.Tensor, bound: float) -> None:
    """Finite and at most `bound` in magnitude: a finite 3e38 would still overflow the receiver's pass."""
    peak = float(tensor.float().abs().max())  # NaN when any value is NaN
    if not math.isfinite(peak):
        raise WireError("data", "contains NaN or Inf")
    if peak > bound:
        raise WireError("data", f"a value of magnitude {peak:.3g} exceeds the bound {bound:.3g}")


_DRIFT_FIELDS = frozenset({"type", "v", "kind", "round", "mb", "base"})


def _drift_frame(message: dict, limits: FrameLimits, round_: int) -> DecodedFrame:
    """A round and a θ round, nothing else: a stage passes the frame on down the chain, so padding would
    cost every later link. Whether this stage can build T_fix' from `base` is the stage's to say."""
    if not limits.d_model:
        raise WireError("kind", "this stage takes no drift frames")
    extra = [key for key in message if key not in _DRIFT_FIELDS]
    if extra:
        raise WireError("drift", f"a drift frame carries a round and a θ round only, not {_shown(extra)}")
    if message["mb"] != 0:
        raise WireError("mb", f"a drift frame has mb 0, got {message['mb']}")
    base = message.get("base")
    if not isinstance(base, int) or isinstance(base, bool) or not -1 <= base < round_:
        raise WireError(
            "base", f"the θ round of round {round_}'s T_fix' must be in [-1, {round_}), got {_shown(base)}"
        )
    return DecodedFrame("drift", round_, 0, torch.empty(0), None, None, base)


def _ids(message: dict, field: str, shape: list[int], vocab: int) -> torch.Tensor | None:
    raw = message.get(field)
    if raw is None:
        return None
    if not isinstance(raw, bytes) or len(raw) != math.prod(shape) * 2:
        raise WireError(field, f"expected {math.prod(shape) * 2} bytes of uint16 ids")
    ids = np.frombuffer(raw, dtype="<u2").astype(np.int64)
    if ids.size and int(ids.max()) >= vocab:
        raise WireError(field, f"token id {int(ids.max())} >= vocab size {vocab}")
    return torch.from_numpy(ids).reshape(shape)
