"""Activation and gradient frames are bounded in magnitude from the model's width: a finite value no honest
stage sends (a bf16 gradient of 3e38) is refused before it reaches the stage's backward pass."""

from __future__ import annotations

import math

import pytest
import torch

from hetnode.daemon.stage_training import frame_limits
from hetnode.errors import WireError
from hetnode.wire.activation_frame import (
    MAX_ACT_RMS,
    MAX_GRAD_RMS,
    FrameLimits,
    decode_frame,
    encode_frame,
    value_bounds,
)


def _ids(limits) -> tuple[torch.Tensor, torch.Tensor]:
    window = torch.randint(0, limits.vocab_size, (limits.batch_size, limits.seq_len + 1))
    return window[:, :-1], window[:, 1:]


def _tensor(limits, value: float) -> torch.Tensor:
    dtype = torch.bfloat16 if limits.dtype == "bf16" else torch.float32
    return torch.full((limits.batch_size, limits.seq_len, limits.width), value).to(dtype)


def test_the_bounds_follow_the_models_width(tiny_config):
    d = tiny_config.model.d_model
    assert value_bounds(d) == (MAX_ACT_RMS * math.sqrt(d), MAX_GRAD_RMS * math.sqrt(d))
    for compressed in (True, False):
        limits = frame_limits(tiny_config, compressed)
        assert (limits.value_bound("act"), limits.value_bound("grad")) == value_bounds(d)


@pytest.mark.parametrize("compressed", [True, False])
def test_a_finite_gradient_of_3e38_is_refused(tiny_config, compressed):
    limits = frame_limits(tiny_config, compressed)
    huge = _tensor(limits, 3e38)
    assert bool(torch.isfinite(huge).all())  # finite in bf16 and fp32: only the bound stops it
    with pytest.raises(WireError, match="exceeds the bound") as info:
        decode_frame(encode_frame("grad", 0, 0, huge), limits, "grad")
    assert info.value.field == "data"


@pytest.mark.parametrize("compressed", [True, False])
def test_an_activation_frame_with_huge_finite_values_is_refused(tiny_config, compressed):
    limits = frame_limits(tiny_config, compressed)
    huge = _tensor(limits, 1e3 * limits.value_bound("act"))
    huge[0, 0, 0] = -huge[0, 0, 0]  # the magnitude counts, not the sign
    with pytest.raises(WireError, match="exceeds the bound") as info:
        decode_frame(encode_frame("act", 0, 0, huge, *_ids(limits)), limits, "act")
    assert info.value.field == "data"


def test_values_just_under_the_bound_pass_and_non_finite_ones_do_not(tiny_config):
    limits = frame_limits(tiny_config, compressed=False)  # fp32: no bf16 rounding across the bound
    for kind in ("act", "grad"):
        ids = _ids(limits) if kind == "act" else ()
        under = _tensor(limits, limits.value_bound(kind) * (1 - 1e-6))
        assert torch.equal(decode_frame(encode_frame(kind, 0, 0, under, *ids), limits, kind).tensor, under)
        for bad in (float("nan"), float("inf")):
            with pytest.raises(WireError, match="NaN or Inf"):
                decode_frame(encode_frame(kind, 0, 0, _tensor(limits, bad), *ids), limits, kind)


def test_limits_built_without_bounds_take_them_from_the_residual_width():
    dense = FrameLimits(2, 8, 64, "bf16", 320)  # no drift width: the frame's width is d
    assert (dense.value_bound("act"), dense.value_bound("grad")) == value_bounds(64)
    compressed = FrameLimits(2, 8, 4, "bf16", 320, d_model=64)  # k = 4 coefficients of a d = 64 stream
    assert (compressed.value_bound("act"), compressed.value_bound("grad")) == value_bounds(64)
