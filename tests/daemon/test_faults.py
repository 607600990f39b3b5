"""Faults as one strategy a role is handed (`hetnode.daemon.faults`): the honest strategy hands back what it
is given, so an honest round's payload is, bit for bit, its Δ compressed with error feedback; every `--fault`
name builds its strategy; an anchor's faults do what they say; each stage fault spoils the frame it says,
and the receiving stage's wire check refuses the NaN, the huge value and the wrong shape."""

from __future__ import annotations

import asyncio
import copy
import math

import msgpack
import pytest
import torch

from hetnode.algo.scoring import dense_update
from hetnode.algo.sparseloco import ErrorFeedback, SparseLoCoCodec
from hetnode.cli.main import build_parser
from hetnode.config import replace
from hetnode.daemon.faults import ANCHOR_FAULTS, FAULT_NAMES, STAGE_FAULTS
from hetnode.daemon.faults.factory import faults_named
from hetnode.daemon.faults.stage import HUGE, SCALE
from hetnode.daemon.faults.strategy import HONEST, Faults
from hetnode.daemon.rounds import AnchorTraining
from hetnode.daemon.stage_training import frame_limits
from hetnode.data.dataset import TokenDataset
from hetnode.errors import WireError
from hetnode.replica.global_model import GlobalModel, sha256_hex
from hetnode.training.faults import STALE_ROUNDS, WORK_FAULTS
from hetnode.wire.activation_frame import decode_frame, encode_frame
from hetnode.wire.sync_payload import SyncPayload, encode_payload


@pytest.fixture(scope="module")
def config(tiny_config):
    return replace(tiny_config, "outer", inner_steps=2)


@pytest.fixture(scope="module")
def dataset(config):
    return TokenDataset.build(config.data, config.model.vocab_size, config.run.seed)


class Recorded(Faults):
    """Honest, and keeps what each round compressed: its Δ and the error feedback it met."""

    def round_update(self, local, round_, peer_id, outer):
        self.delta = local.pseudo_gradient()
        self.feedback = copy.deepcopy(local.feedback.state_dict())
        return super().round_update(local, round_, peer_id, outer)


def test_every_fault_name_builds_its_own_strategy_and_no_name_is_honest():
    assert faults_named(None) is HONEST
    assert set(WORK_FAULTS) | {"nan", "digest", "drift"} == set(ANCHOR_FAULTS)
    assert len(STAGE_FAULTS) == 15 and len(set(FAULT_NAMES)) == len(FAULT_NAMES)
    for name in FAULT_NAMES:
        faults = faults_named(name)
        assert type(faults) is not Faults and faults.name == name
        args = build_parser().parse_args(["join", "--peer", "http://127.0.0.1:1", "--fault", name])
        assert args.fault == name  # the CLI's hidden flag takes every one
    assert faults_named("stale") is not faults_named("stale")  # each role its own θ history
    with pytest.raises(ValueError, match="unknown fault 'sneaky'"):
        faults_named("sneaky")


def test_the_honest_hooks_hand_back_what_they_are_given(config):
    theta = GlobalModel(config)
    theta.params_round = 1  # where the drift fault strikes
    held = theta.digests()
    payloads = {"0": b"message"}
    digests = {"0": sha256_hex(b"message")}
    assert HONEST.payload_bytes(payloads) is payloads
    assert HONEST.announced_digests(digests, payloads) is digests
    assert HONEST.train_from(theta) is theta
    assert asyncio.run(HONEST.announced_payloads(None, theta, 1, payloads, asyncio.Event())) is payloads
    assert HONEST.after_apply(theta) is False and theta.digests() == held
    tensor = torch.randn(2, 3, 4)
    assert HONEST.sent_activations(tensor) is tensor and HONEST.sent_gradients(tensor) is tensor
    assert HONEST.closes_aside


def test_an_honest_round_sends_its_delta_through_error_feedback_bit_for_bit(config, dataset):
    theta = GlobalModel(config)
    plain, recorded = AnchorTraining(config, dataset, "peer-a"), Recorded()
    twin = AnchorTraining(config, dataset, "peer-a", faults=recorded)
    o = config.outer
    for round_ in range(2):  # the second round meets the error feedback the first one left
        sent = plain.run_round(round_, theta)
        assert twin.run_round(round_, theta) == sent
        assert bool(recorded.feedback["buffers"]) == (round_ > 0)
        feedback = ErrorFeedback(SparseLoCoCodec(o.topk, o.tile), o.error_feedback)
        feedback.load_state_dict(recorded.feedback)
        compressed = feedback.compress(recorded.delta)
        expected = {
            shard: encode_payload(
                SyncPayload(
                    "peer-a",
                    round_,
                    shard,
                    "sparseloco",
                    {n: compressed[n] for n in names},
                    base=theta.params_round,
                )
            )
            for shard, names in plain.shards.items()
        }
        assert sent == expected
    assert plain.feedback_norm() > 0


def test_a_pseudo_gradient_fault_sends_its_fault_keeps_no_error_feedback_and_closes_in_line(config, dataset):
    theta = GlobalModel(config)
    shapes = {n: tuple(t.shape) for n, t in theta.params.items()}
    honest = AnchorTraining(config, dataset, "peer-f")
    flipper = AnchorTraining(config, dataset, "peer-f", faults=faults_named("signflip"))
    flipper.close_aside()
    assert flipper.closer is None  # its Δ is its fault: nothing to split off error feedback

    def update(training: AnchorTraining, round_: int) -> dict[str, torch.Tensor]:
        decoded = theta.decode_contribution("peer-f", round_, training.run_round(round_, theta))
        return dense_update({n: v for m in decoded for n, v in m.sparse.items()}, shapes)

    for round_ in range(2):
        ours, theirs = update(honest, round_), update(flipper, round_)
        assert sum(float((ours[n] * theirs[n]).sum()) for n in shapes) < 0  # the same work, sent backwards
    assert flipper.feedback_norm() == 0 and not flipper.local.unsent
    assert honest.feedback_norm() > 0


def test_the_anchor_faults_spoil_what_they_say(config):
    theta = GlobalModel(config)
    message = _encoded_round(config, theta)
    payloads = {"0": message}
    nan = faults_named("nan").payload_bytes(payloads)
    assert payloads == {"0": message} and nan.keys() == payloads.keys()  # ours as they were
    spoiled, original = (msgpack.unpackb(data, raw=False) for data in (nan["0"], message))
    assert spoiled["tensors"] and all(math.isnan(t["q"][0]) for t in spoiled["tensors"])
    for key in ("replica", "round", "shard", "base"):
        assert spoiled[key] == original[key]
    for ours, theirs in zip(original["tensors"], spoiled["tensors"], strict=True):  # the rest as it was
        assert (ours["name"], ours["idx"], ours["codes"]) == (theirs["name"], theirs["idx"], theirs["codes"])

    honest = {"0": sha256_hex(message)}
    lies = faults_named("digest").announced_digests(honest, payloads)
    assert lies.keys() == honest.keys() and lies["0"] != sha256_hex(message)

    drift, held = faults_named("drift"), theta.digests()
    theta.params_round = 0
    assert not drift.after_apply(theta) and theta.digests() == held
    theta.params_round = 1
    assert drift.after_apply(theta)
    assert sum(a != b for a, b in zip(theta.digests().values(), held.values(), strict=True)) == 1

    stale, rounds = faults_named("stale"), []
    for round_ in range(STALE_ROUNDS + 3):
        theta.params_round = round_
        rounds.append(stale.train_from(theta).params_round)
    assert rounds == [0, 0, 0, 0, 1, 2]  # θ STALE_ROUNDS rounds back, once it has them


def _encoded_round(config, theta: GlobalModel) -> bytes:
    """One shard's message with real compressed tensors in it."""
    o = config.outer
    names = theta.shards["0"]
    delta = {n: torch.randn(theta.params[n].shape, generator=torch.Generator().manual_seed(1)) for n in names}
    compressed = ErrorFeedback(SparseLoCoCodec(o.topk, o.tile), o.error_feedback).compress(delta)
    return encode_payload(SyncPayload("peer-x", 0, "0", "sparseloco", compressed, base=-1))


@pytest.mark.parametrize("name", [f for f in STAGE_FAULTS if not f.startswith("frames-")])
def test_each_stage_fault_spoils_the_frame_it_says_and_the_wire_refuses_the_broken_ones(config, name):
    kind, fault = name.split("-", 1)
    limits = frame_limits(config, compressed=True)
    d = config.data
    shape = (d.batch_size, d.seq_len, config.pipeline.subspace_rank)
    generator = torch.Generator().manual_seed(3)
    honest = (torch.randn(shape, generator=generator) * (0.3 if kind == "act" else 1e-3)).to(torch.bfloat16)
    before = honest.clone()
    faults = faults_named(name)
    if kind == "act":
        sent, other = faults.sent_activations(honest), faults.sent_gradients(honest)
        window = torch.randint(0, config.model.vocab_size, (d.batch_size, d.seq_len + 1), generator=generator)
        data = encode_frame("act", 0, 0, sent, window[:, :-1], window[:, 1:])
    else:
        sent, other = faults.sent_gradients(honest), faults.sent_activations(honest)
        data = encode_frame("grad", 0, 0, sent)
    assert other is honest  # the other direction stays honest
    assert torch.equal(honest, before)  # our own tensor untouched: only the neighbour sees the fault
    refusals = {
        "nan": ("data", "NaN or Inf"),
        "huge": ("data", "exceeds the bound"),
        "shape": ("shape", "expected"),
    }
    if fault in refusals:
        field, says = refusals[fault]
        with pytest.raises(WireError, match=says) as refused:
            decode_frame(data, limits, kind, expect_round=0)
        assert refused.value.field == field
        if fault == "shape":
            assert tuple(sent.shape) == (*shape[:2], shape[2] + 1)
        else:
            spoilt = sent.view(-1)
            assert torch.equal(spoilt[1:], honest.view(-1)[1:])  # one value, the first
            assert (
                math.isnan(spoilt[0]) if fault == "nan" else float(spoilt[0]) == pytest.approx(HUGE, rel=1e-2)
            )
        return
    received = decode_frame(data, limits, kind, expect_round=0).tensor  # valid: the wire passes it
    wanted = -honest if fault == "signflip" else honest * SCALE
    assert torch.equal(received, wanted) and not torch.equal(received, honest)


def test_a_frames_fault_spoils_both_directions():
    honest = torch.ones(2, 3, 4)
    faults = faults_named("frames-signflip")
    assert torch.equal(faults.sent_activations(honest), -honest)
    assert torch.equal(faults.sent_gradients(honest), -honest)
