"""A stage before a pool of W workers steps once per W gradients (issue 38): W times the 1F1B window can be
in flight while each micro-batch's weight delay, counted in steps, stays P−1−s; the step is the mean of
the group's gradients; a round's last, partial group is applied by `flush`."""

from __future__ import annotations

import pytest
import torch
from torch.func import functional_call

from hetnode.config import Config
from hetnode.model.decoder import build_stage
from hetnode.planning.layer_split import split_layers
from hetnode.training.stage_worker import StageWorker

LR = 0.1


def first_stage(config: Config, accumulate: int) -> StageWorker:
    splits = split_layers(config.model.n_layers, [1.0, 1.0])
    stage = build_stage(config.model, splits, 0, seed=0)
    worker = StageWorker(stage, torch.optim.SGD(stage.parameters(), lr=LR), lambda step: LR)
    worker.accumulate = accumulate
    return worker


def batch(config: Config, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, config.model.vocab_size, (2, 16), generator=g)
    return tokens, tokens.roll(-1, dims=1)


def grad_for(frame, seed: int) -> torch.Tensor:
    return torch.randn(frame.tensor.shape, generator=torch.Generator().manual_seed(100 + seed))


def test_the_step_is_the_mean_of_the_groups_gradients(tiny_config):
    worker = first_stage(tiny_config, accumulate=2)
    before = {n: p.detach().clone() for n, p in worker.stage.named_parameters()}
    expected = {n: torch.zeros_like(p) for n, p in before.items()}
    for mb in range(2):
        tokens, targets = batch(tiny_config, mb)
        frame = worker.forward(mb, (tokens, targets))
        grad = grad_for(frame, mb)
        # the gradient of this micro-batch alone, on the weights it ran on
        params = {n: p.clone().requires_grad_(True) for n, p in before.items()}
        out = functional_call(worker.stage, params, (tokens,))
        found = torch.autograd.grad(out, list(params.values()), grad, allow_unused=True)
        for (name, _), g in zip(params.items(), found, strict=True):
            if g is not None:
                expected[name] += g / 2
        worker.backward(mb, grad)
        assert worker.version == mb  # the first gradient is held back, the second steps
    assert worker.applied == 2 and worker.held_back == 0
    for name, param in worker.stage.named_parameters():
        torch.testing.assert_close(param.detach(), before[name] - LR * expected[name], rtol=1e-4, atol=1e-6)


def test_twice_the_window_in_flight_keeps_the_delay_in_steps(tiny_config):
    """P = 2, s = 0, a pool of 2 after it: 4 in flight, room back with each step, delay ≤ P−1−s = 1."""
    worker = first_stage(tiny_config, accumulate=2)
    window, fed, frames = 2 * 2, 0, {}
    for answer in range(12):
        while fed < 12 and len(worker.in_flight) + worker.held_back < window:
            frames[fed] = worker.forward(fed, batch(tiny_config, fed))
            fed += 1
        worker.backward(answer, grad_for(frames[answer], answer))
    assert fed == 12 and worker.applied == 12 and worker.version == 6
    delays = [delay for _, delay in worker.staleness]
    assert max(delays) == 1 and delays.count(1) >= 8


@pytest.mark.parametrize("held", [1, 2])
def test_flush_applies_a_partial_group_and_a_broken_round_drops_it(tiny_config, held):
    worker = first_stage(tiny_config, accumulate=3)
    for mb in range(held):
        frame = worker.forward(mb, batch(tiny_config, mb))
        worker.backward(mb, grad_for(frame, mb))
    assert worker.version == 0 and worker.held_back == held
    assert worker.flush() == held and worker.version == 1 and worker.applied == held
    assert worker.flush() == 0
    frame = worker.forward(9, batch(tiny_config, 9))
    worker.backward(9, grad_for(frame, 9))
    worker.drop_in_flight()  # the chain lost a member: held-back work goes with the rest
    assert worker.held_back == 0 and worker.flush() == 0 and worker.version == 1
