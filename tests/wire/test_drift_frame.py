"""Once per round the first stage names the θ round whose embedding gives the round's T_fix'; every stage of
a compressed chain holds θ's embedding and builds the same T_fix' from it, so no V×d frame crosses the
chain. A drift frame is a few bytes and nothing else passes as one."""

from __future__ import annotations

import msgpack
import pytest
import torch

from hetnode.daemon.stage_training import (
    KEPT_EMBEDDINGS,
    StageTraining,
    drift_refusal,
    frame_limits,
    stage_part,
)
from hetnode.data.dataset import TokenDataset
from hetnode.errors import WireError
from hetnode.replica.global_model import GlobalModel
from hetnode.wire.activation_frame import FrameLimits, decode_frame, encode_drift

LIMITS = FrameLimits(batch_size=2, seq_len=8, width=4, dtype="bf16", vocab_size=64, d_model=16)


def test_a_drift_frame_names_a_theta_round_in_a_few_bytes():
    frame = decode_frame(encode_drift(7, 5), LIMITS, expect_kind=("act", "drift"))
    assert (frame.kind, frame.round, frame.base) == ("drift", 7, 5)
    assert decode_frame(encode_drift(0, -1), LIMITS, expect_kind=("act", "drift")).base == -1  # initial θ
    assert len(encode_drift(10**6, 10**6 - 1)) < 64  # was V×d fp32: 67 MB at 178m, 134 MB at 1b


@pytest.mark.parametrize(
    "change",
    [
        lambda m: m.update(base=7),  # not before its round
        lambda m: m.update(base=-2),
        lambda m: m.update(base="5"),
        lambda m: m.update(base=True),
        lambda m: m.pop("base"),
        lambda m: m.update(base=5.0),
        lambda m: m.update(base=None),
        lambda m: m.update(base=[5]),
        lambda m: m.update(base=-(2**63)),  # the most negative msgpack integer
        lambda m: m.update(base=2**64 - 1),  # the largest
    ],
)
def test_a_drift_frame_naming_no_earlier_theta_round_is_refused(change):
    message = msgpack.unpackb(encode_drift(7, 5), raw=False)
    change(message)
    with pytest.raises(WireError) as error:
        decode_frame(msgpack.packb(message, use_bin_type=True), LIMITS, expect_kind=("act", "drift"))
    assert error.value.field == "base"


@pytest.mark.parametrize(
    ("change", "field"),
    [
        (lambda m: m.update(data=b"\0" * 4096), "drift"),  # padding every later stage would pass on
        (lambda m: m.update(shape=[2, 8, 4]), "drift"),
        (lambda m: m.update(mb=3), "mb"),
    ],
)
def test_a_drift_frame_carries_its_round_and_theta_round_only(change, field):
    message = msgpack.unpackb(encode_drift(7, 5), raw=False)
    change(message)
    with pytest.raises(WireError) as error:
        decode_frame(msgpack.packb(message, use_bin_type=True), LIMITS, expect_kind=("act", "drift"))
    assert error.value.field == field


def test_a_hostile_value_is_quoted_cut_short():
    """The error ends up in a log line: a megabyte string must not."""
    message = msgpack.unpackb(encode_drift(7, 5), raw=False) | {"base": "5" * 2**20}
    with pytest.raises(WireError) as error:
        decode_frame(msgpack.packb(message, use_bin_type=True), LIMITS, expect_kind=("act", "drift"))
    assert len(str(error.value)) < 200 and f"({2**20 + 2} characters)" in str(error.value)


def test_the_wire_passes_a_far_round_on_to_the_stage():
    """The frame alone cannot say whether a round is too far ahead: the stage's rules do (`drift_refusal`,
    then the round's opening)."""
    far = 2**64 - 1
    assert decode_frame(encode_drift(far, far - 1), LIMITS, expect_kind=("act", "drift")).base == far - 1


@pytest.mark.parametrize(
    ("round_", "base", "oldest", "newest", "refusal"),
    [
        (7, 6, 7, 6, None),  # lockstep: θ of the round before
        (7, 5, 6, 6, None),  # overlapped: two rounds back, the round before still syncing
        (7, 7 - KEPT_EMBEDDINGS, 6, 6, None),  # the oldest a stage keeps
        (7, 6 - KEPT_EMBEDDINGS, 6, 6, "rounds back"),
        (7, -1, 0, -1, "rounds back"),  # the initial θ, long gone by round 7
        (7, 6, 7, 7, "a second drift frame for round 7"),
        (7, 6, 7, 9, "a second drift frame"),  # a round this stage is past
        (5, 4, 7, 4, "not the next round"),
        (10**12, 10**12 - 1, 0, -1, None),  # too far ahead: refused when the round opens, after a catch-up
    ],
)
def test_what_a_stage_takes_from_a_drift_frame(round_, base, oldest, newest, refusal):
    verdict = drift_refusal(round_, base, oldest, newest)
    assert verdict is None if refusal is None else refusal in verdict


def test_drift_frames_only_where_expected():
    data = encode_drift(1, 0)
    with pytest.raises(WireError, match="expected 'act'"):
        decode_frame(data, LIMITS, expect_kind="act")  # e.g. on the gradient stream
    no_drift = FrameLimits(2, 8, 4, "bf16", 64)  # an uncompressed chain has no T_fix'
    with pytest.raises(WireError, match="no drift frames"):
        decode_frame(data, no_drift, expect_kind=("act", "drift"))


def test_every_stage_builds_the_first_stages_t_fix_from_the_theta_round_it_names(tiny_config):
    """T_fix' = T_fix + (T_S − P(T_S)) of θ's embedding after the named round: the last stage, ahead of the
    first by a round, gets the same bits from the embedding it kept."""
    config = tiny_config
    n = config.model.n_layers
    splits = (range(0, n // 2), range(n // 2, n))
    dataset = TokenDataset.build(config.data, config.model.vocab_size, config.run.seed)
    first = StageTraining(config, splits, 0, "chain-x", dataset)
    last = StageTraining(config, splits, 1, "chain-x", None)
    assert not first.needs_drift and last.needs_drift
    front, back = (GlobalModel(config, part=stage_part(splits, i, compressed=True)) for i in range(2))
    assert "embed" in back.shards and "embed" not in last.shards  # held and synced, not trained
    with torch.no_grad():  # a θ whose embedding has left the subspace, as anchors' updates make it
        noise = torch.randn_like(front.params["embed.weight"]) * 0.01
        for model in (front, back):
            model.params["embed.weight"].add_(noise)
    first.rebase(first.rebase_from(front))
    last.rebase(last.rebase_from(back))
    with torch.no_grad():  # the last stage applied the next seal already; the first has not
        back.params["embed.weight"].add_(noise)
        back.params_round = 0
    last.rebase(last.rebase_from(back))
    first.begin_round(1)
    assert first.drift_base == -1 and float(first.drift.abs().max()) > 0
    with pytest.raises(ValueError, match="drift"):
        last.begin_round(1)
    sent = decode_frame(encode_drift(1, first.drift_base), frame_limits(config, True), ("act", "drift"))
    last.begin_round(1, sent.base)
    assert torch.equal(last.worker.constraint.fixed, first.worker.constraint.fixed)
    with pytest.raises(ValueError, match="no embedding of θ after round 5"):
        last.begin_round(2, 5)  # a θ round it never stood on


def test_a_stage_keeps_the_embeddings_of_its_newest_theta_rounds_only(tiny_config):
    n = tiny_config.model.n_layers
    splits = (range(0, n // 2), range(n // 2, n))
    last = StageTraining(tiny_config, splits, 1, "chain-x", None)
    back = GlobalModel(tiny_config, part=stage_part(splits, 1, compressed=True))
    for round_ in range(-1, KEPT_EMBEDDINGS + 2):
        back.params_round = round_
        last.rebase(last.rebase_from(back))
    assert sorted(last.embeddings) == list(range(2, KEPT_EMBEDDINGS + 2))
