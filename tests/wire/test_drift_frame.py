"""The first stage's embedding drift crosses the chain once per round, exactly, and nothing else passes
as one; a stage without the embedding builds the same T_fix' from it as the first stage."""

from __future__ import annotations

import msgpack
import pytest
import torch

from hetnode.daemon.stage_training import StageTraining, frame_limits
from hetnode.data.dataset import TokenDataset
from hetnode.errors import WireError
from hetnode.model.shards import ModelPart
from hetnode.replica.global_model import GlobalModel
from hetnode.wire.activation_frame import FrameLimits, decode_frame, encode_frame

LIMITS = FrameLimits(batch_size=2, seq_len=8, width=4, dtype="bf16", vocab_size=64, d_model=16)


def test_a_drift_frame_round_trips_bit_exactly():
    drift = torch.randn(64, 16) * 1e-3
    frame = decode_frame(encode_frame("drift", 7, 0, drift), LIMITS, expect_kind=("act", "drift"))
    assert frame.kind == "drift" and frame.round == 7 and torch.equal(frame.tensor, drift)
    assert len(encode_frame("drift", 7, 0, drift)) <= LIMITS.drift_bytes()


@pytest.mark.parametrize(
    "change, field",
    [
        (lambda m: m.update(shape=[63, 16]), "shape"),
        (lambda m: m.update(dtype="bf16"), "dtype"),
        (lambda m: m.update(data=m["data"][:-4]), "data"),
        (lambda m: m.update(data=torch.full((64, 16), float("nan")).numpy().tobytes()), "data"),
        (lambda m: m.update(data=torch.full((64, 16), 1e6).numpy().tobytes()), "data"),
    ],
)
def test_a_malformed_drift_frame_is_refused(change, field):
    message = msgpack.unpackb(encode_frame("drift", 1, 0, torch.zeros(64, 16)), raw=False)
    change(message)
    with pytest.raises(WireError) as error:
        decode_frame(msgpack.packb(message, use_bin_type=True), LIMITS, expect_kind=("act", "drift"))
    assert error.value.field == field


def test_drift_frames_only_where_expected():
    data = encode_frame("drift", 1, 0, torch.zeros(64, 16))
    with pytest.raises(WireError, match="expected 'act'"):
        decode_frame(data, LIMITS, expect_kind="act")  # e.g. on the gradient stream
    no_drift = FrameLimits(2, 8, 4, "bf16", 64)  # an uncompressed chain has no drift to send
    with pytest.raises(WireError, match="no drift frames"):
        decode_frame(data, no_drift, expect_kind=("act", "drift"))


def test_a_stage_without_the_embedding_builds_the_first_stages_t_fix(tiny_config):
    """T_fix' = T_fix + (T_S − P(T_S)): the last stage, given the first stage's drift, gets the same bits."""
    config = tiny_config
    n = config.model.n_layers
    splits = (range(0, n // 2), range(n // 2, n))
    dataset = TokenDataset.build(config.data, config.model.vocab_size, config.run.seed)
    first = StageTraining(config, splits, 0, "chain-x", dataset)
    last = StageTraining(config, splits, 1, "chain-x", None)
    assert not first.needs_drift and last.needs_drift
    with torch.no_grad():  # a θ whose embedding has left the subspace, as anchors' updates make it
        front = GlobalModel(config, part=ModelPart.of_stage(splits, 0))
        front.params["embed.weight"].add_(torch.randn_like(front.params["embed.weight"]) * 0.01)
    first.rebase(first.rebase_from(front))
    first.begin_round(0)
    assert first.drift is not None and float(first.drift.abs().max()) > 0
    back = GlobalModel(config, part=ModelPart.of_stage(splits, 1))
    last.rebase(last.rebase_from(back))
    with pytest.raises(ValueError, match="drift"):
        last.begin_round(0)
    limits = frame_limits(config, compressed=True)
    sent = decode_frame(encode_frame("drift", 0, 0, first.drift), limits, expect_kind=("act", "drift"))
    last.begin_round(0, sent.tensor)
    assert torch.equal(last.worker.constraint.fixed, first.worker.constraint.fixed)
