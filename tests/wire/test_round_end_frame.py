"""Paced rounds: the first stage ends a round with a frame that says how many micro-batches it had. It
round-trips, is only taken where asked for, and its count is an integer a stage then checks."""

from __future__ import annotations

import msgpack
import pytest

from hetnode.errors import WireError
from hetnode.wire.activation_frame import FrameLimits, decode_frame, encode_round_end

LIMITS = FrameLimits(batch_size=2, seq_len=8, width=4, dtype="bf16", vocab_size=64)


def test_a_round_end_frame_round_trips_and_is_small():
    data = encode_round_end(9, 17)
    frame = decode_frame(data, LIMITS, expect_kind=("act", "end"))
    assert (frame.kind, frame.round, frame.mb, frame.tensor.numel()) == ("end", 9, 17, 0)
    assert len(data) < 64
    with pytest.raises(WireError, match="kind"):  # a stage that did not ask for end frames refuses one
        decode_frame(data, LIMITS, expect_kind="act")


@pytest.mark.parametrize("count", [-1, 1.5, True, "3", None])
def test_a_round_end_frame_with_a_count_that_is_not_a_count_is_refused(count):
    message = msgpack.unpackb(encode_round_end(9, 1), raw=False)
    message["mb"] = count
    with pytest.raises(WireError, match="mb"):
        decode_frame(msgpack.packb(message), LIMITS, expect_kind=("act", "end"))
