"""The asynchronous 1F1B chain: delays are exactly P−1−s, P=1 is plain training, frames are validated."""

import msgpack
import pytest
import torch

from hetnode.config import Config, replace
from hetnode.data import TokenDataset
from hetnode.errors import WireError
from hetnode.lab.sim.pipeline import PipelineChain, build_chain_workers
from hetnode.planning.layer_split import split_layers
from hetnode.training.trainer import InnerTrainer
from hetnode.wire.activation_frame import FrameLimits, decode_frame, encode_frame


@pytest.fixture(scope="module")
def config(tiny_config: Config) -> Config:
    config = replace(tiny_config, "data", batch_size=4)
    config = replace(config, "train", max_steps=40, eval_batches=2)
    return replace(config, "inner", grad_clip=0.0)


@pytest.fixture(scope="module")
def dataset(config: Config) -> TokenDataset:
    return TokenDataset.build(config.data, config.model.vocab_size, seed=config.run.seed)


def _chain(config, dataset, stages, compress=False, limits=None):
    splits = split_layers(config.model.n_layers, [1.0] * stages)
    workers = build_chain_workers(config, splits, "adamw", compress=compress, constrained=compress, seed=0)
    return PipelineChain(workers, dataset, limits=limits)


@pytest.mark.parametrize("stages", [2, 4])
def test_stage_delay_is_p_minus_1_minus_s(config, dataset, stages):
    chain = _chain(config, dataset, stages)
    chain.run(12)
    for s, worker in enumerate(chain.workers):
        delays = dict(worker.staleness)
        assert sorted(delays) == list(range(12))
        tau = stages - 1 - s
        # after the warm-up, every update was computed on weights exactly tau updates old
        assert all(delays[mb] == tau for mb in range(tau, 12)), (s, delays)
        assert all(delays[mb] == mb for mb in range(tau)), (s, delays)  # warm-up: fewer updates existed
        assert not worker.in_flight  # drained


def test_single_stage_chain_is_plain_training(config, dataset):
    from hetnode.model import build_model

    chain = _chain(config, dataset, 1)
    stats = chain.run(5)
    trainer = InnerTrainer(config, build_model(config.model, seed=0), dataset)
    losses = [trainer.train_step().loss for _ in range(5)]
    assert stats.losses == pytest.approx(losses, rel=1e-5)
    ref = dict(trainer.model.named_parameters())
    for name, p in chain.params().items():
        torch.testing.assert_close(p, ref[name], rtol=1e-5, atol=1e-6, msg=name)


def test_compressed_chain_counts_bytes_and_learns(config, dataset):
    d, k = config.model.d_model, config.pipeline.subspace_rank
    limits = FrameLimits(config.data.batch_size, config.data.seq_len, k, "bf16", config.model.vocab_size)
    chain = _chain(config, dataset, 2, compress=True, limits=limits)
    before = chain.evaluate(2)
    stats = chain.run(30)
    assert chain.evaluate(2) < before - 0.8
    tokens_per_mb = config.data.batch_size * config.data.seq_len
    per_token = stats.activation_bytes / (30 * tokens_per_mb)
    # k bf16 coefficients + one uint16 id per token (the T+1 window), plus a small header
    assert 2 * (k + 1) <= per_token <= 2 * (k + 1) * 1.02
    assert (2 * d + 2) / per_token >= 0.98 * d / (k + 1)  # vs dense bf16 with the same ids


def _limits(**overrides):
    base = dict(batch_size=2, seq_len=8, width=4, dtype="bf16", vocab_size=320)
    return FrameLimits(**{**base, **overrides})


def _frame(**overrides):
    args = dict(
        tensor=torch.randn(2, 8, 4).to(torch.bfloat16),
        tokens=torch.randint(0, 320, (2, 8)),
        targets=torch.randint(0, 320, (2, 8)),
    )
    args.update(overrides)
    return encode_frame("act", 0, 7, args["tensor"], args["tokens"], args["targets"])


@pytest.mark.parametrize("shifted", [True, False])
def test_frame_round_trip(shifted):
    t = torch.randn(2, 8, 4).to(torch.bfloat16)
    window = torch.randint(0, 320, (2, 9))
    tokens, targets = window[:, :-1], window[:, 1:] if shifted else torch.randint(0, 320, (2, 8))
    data = encode_frame("act", 3, 7, t, tokens, targets)
    decoded = decode_frame(data, _limits(), "act", expect_round=3)
    assert torch.equal(decoded.tensor, t) and decoded.mb == 7
    assert torch.equal(decoded.tokens, tokens) and torch.equal(decoded.targets, targets)
    assert ("ids" in msgpack.unpackb(data)) == shifted


@pytest.mark.parametrize(
    ("data", "limits", "field"),
    [
        (lambda: _frame(tensor=torch.randn(2, 8, 5).to(torch.bfloat16)), _limits(), "shape"),  # wrong rank k
        (lambda: _frame(tokens=torch.full((2, 8), 400)), _limits(), "tokens"),  # id >= vocab
        (lambda: _frame(targets=torch.full((2, 8), 320)), _limits(), "targets"),
        (lambda: _frame(tokens=torch.full((2, 8), 330), targets=torch.full((2, 8), 330)), _limits(), "ids"),
        (lambda: _frame(tensor=torch.full((2, 8, 4), float("nan")).to(torch.bfloat16)), _limits(), "data"),
        (lambda: _frame(tensor=torch.randn(2, 8, 4)), _limits(), "dtype"),  # fp32 where bf16 expected
        (lambda: _frame(tensor=torch.randn(3, 8, 4).to(torch.bfloat16)), _limits(), "shape"),  # batch too big
        (lambda: _frame(), _limits(max_bytes=64), "size"),
        (lambda: _frame()[:-3], _limits(), "msgpack"),
    ],
)
def test_frame_validation_rejects(data, limits, field):
    with pytest.raises(WireError) as info:
        decode_frame(data(), limits, "act")
    assert info.value.field == field


def test_frame_of_another_round_is_refused():
    with pytest.raises(WireError) as info:
        decode_frame(_frame(), _limits(), "act", expect_round=1)
    assert info.value.field == "round"
