"""A round's payload made off the training thread (`LocalRounds.split` / `close` / `take_closed`): the same
payload and working weights as compressing in line when taken back before the next step; progress since the
split kept when taken later; the guess dropped when θ lands first; a left-out round restored either way;
and an overlapped anchor whose training thread goes on while the closer works."""

import threading

import pytest
import torch

from hetnode.algo.sparseloco import ErrorFeedback, SparseLoCoCodec
from hetnode.config import Config, replace
from hetnode.daemon.rounds import AnchorTraining
from hetnode.data import TokenDataset
from hetnode.replica.global_model import GlobalModel
from hetnode.training.local_rounds import LocalRounds, Rebase, RebaseInbox

CODEC = SparseLoCoCodec(64, 64)


def _local(ahead_from: str = "eager") -> LocalRounds:
    params = {"w": torch.nn.Parameter(torch.zeros(128))}
    local = LocalRounds(params, ErrorFeedback(CODEC, 0.95), ahead_from, outer_lr=2.0)  # type: ignore[arg-type]
    local.rebase(Rebase(0, 1, {"w": torch.zeros(128)}, None, {"w": torch.zeros(128)}, None, (), share=0.25))
    return local


def _train(local: LocalRounds, step: torch.Tensor) -> None:
    with torch.no_grad():
        local.params["w"].sub_(step)


STEP_1 = torch.linspace(0.1, 1.0, 128)
STEP_2 = torch.linspace(-1.0, 0.3, 128)


@pytest.mark.parametrize("ahead_from", ["eager", "theta", "local"])
def test_taken_back_before_the_next_step_it_is_exactly_the_close_in_line(ahead_from):
    inline, aside = _local(ahead_from), _local(ahead_from)
    for local in (inline, aside):
        _train(local, STEP_1)
    sent = inline.compress(1)
    closing = aside.split(1)
    aside.close(closing)
    assert aside.take_closed(wait=False)
    assert closing.compressed["w"] == sent["w"]
    assert torch.equal(aside.params["w"].detach(), inline.params["w"].detach())
    assert torch.equal(aside.start["w"], inline.start["w"])
    assert torch.equal(aside.feedback.buffers["w"], inline.feedback.buffers["w"])
    assert set(aside.unsent) == set(inline.unsent) == {1}
    for local in (inline, aside):  # and the next round's Δ is the same
        _train(local, STEP_2)
    assert torch.equal(aside.pseudo_gradient()["w"], inline.pseudo_gradient()["w"])


def test_steps_taken_while_it_closes_are_kept_on_top_of_the_guess():
    local = _local()
    _train(local, STEP_1)
    closing = local.split(1)
    assert not local.take_closed(wait=False)  # not compressed yet: the training thread goes on
    _train(local, STEP_2)  # a step of round 2 before the payload is ready
    local.close(closing)
    assert local.take_closed(wait=False)
    guess = -2.0 * 0.25 * CODEC.decompress(closing.compressed["w"])
    assert torch.allclose(local.params["w"].detach(), guess - STEP_2, atol=1e-6)
    assert torch.equal(local.start["w"], guess)
    assert torch.allclose(local.pseudo_gradient()["w"], STEP_2, atol=1e-6)  # round 2's Δ: only its step


def test_theta_landing_first_makes_the_guess_moot():
    local = _local()
    _train(local, STEP_1)
    closing = local.split(1)
    _train(local, STEP_2)
    theta = {"w": torch.full((128,), 5.0)}
    local.rebase(Rebase(1, 2, theta, None, theta, None, ()))  # θ¹ without us (we were late)
    local.close(closing)
    local.take_closed(wait=True)
    assert torch.allclose(local.params["w"].detach(), theta["w"] - STEP_2, atol=1e-6)
    assert local.unsent == {}  # sealed meanwhile: its fate is unknown, never sent twice


def test_a_round_left_out_before_it_was_taken_back_goes_back_into_error_feedback():
    local = _local()
    _train(local, STEP_1)
    closing = local.split(1)
    local.close(closing)
    residual = local.feedback.buffers["w"].clone()
    theta = {"w": torch.zeros(128)}
    local.rebase(Rebase(1, 2, theta, None, theta, None, (1,)))  # left out of round 1's seal
    local.take_closed(wait=False)
    assert torch.allclose(local.feedback.buffers["w"], residual + CODEC.decompress(closing.compressed["w"]))
    assert local.unsent == {}


def test_a_second_split_before_the_first_is_taken_back_is_refused():
    local = _local()
    local.split(1)
    with pytest.raises(RuntimeError, match="never taken back"):
        local.split(2)


def test_a_failed_close_raises_on_the_training_thread():
    local = _local()
    with torch.no_grad():
        local.params["w"][0] = float("inf")
    closing = local.split(1)
    local.close(closing)
    assert closing.done.is_set() and closing.error is not None
    with pytest.raises(ValueError):
        local.take_closed(wait=True)


@pytest.fixture
def dataset(tiny_config: Config) -> TokenDataset:
    return TokenDataset.build(tiny_config.data, tiny_config.model.vocab_size, seed=tiny_config.run.seed)


def test_an_anchor_closing_aside_trains_the_next_round_while_the_payload_is_made(tiny_config, dataset):
    config = replace(tiny_config, "outer", inner_steps=2)
    model = GlobalModel(config)
    training = AnchorTraining(config, dataset, "peer-a")
    training.rebase(training.rebase_from(model))
    training.close_aside()
    gate = threading.Event()
    close = training.local.close

    def held_close(closing):  # the closer holds round 0's payload until round 1 has trained
        gate.wait(60)
        close(closing)

    training.local.close = held_close  # type: ignore[method-assign]
    try:
        first = training.train_round(0)
        assert first.closing is not None and not first.sat_out and not first.closing.done()
        inbox = RebaseInbox()
        model.params_round = 0  # θ after round 0 (unchanged weights: only the label matters)
        inbox.post(training.rebase_from(model))
        result = {}
        worker = threading.Thread(target=lambda: result.update(r=training.train_round(1, inbox)))
        worker.start()
        deadline = 60.0
        while training.trainer.step < 4 and deadline > 0:  # round 1's steps run while round 0 closes
            worker.join(0.05)
            deadline -= 0.05
        assert training.trainer.step == 4 and not first.closing.done()
        gate.set()
        payloads = first.closing.result(60)
        worker.join(60)
        assert set(payloads) == set(training.shards) and first.timing.close_s > 0
        assert result["r"].round == 1 and result["r"].closing is not None
        result["r"].closing.result(60)
    finally:
        gate.set()
        training.stop_closing()
