"""A chain stage's forward and backward never make the host wait for the device (issue 36), counted on CPU
with `HostSyncs` (every read of a tensor's value reaches `aten._local_scalar_dense`, on CPU too).

What the wire needs is a copy to the host of every frame a stage sends (activations down, gradients up);
those copies are not reads of a value, and the checks of the gradients that go upstream run on them in
numpy. The loss stays on the device until asked for. The first stage sends no gradient: it reads one flag
per backward to refuse an unsafe one before its step, unless `defer_refusals`."""

from __future__ import annotations

import math

import pytest
import torch

from hetnode.config import Config, replace
from hetnode.data import TokenDataset
from hetnode.lab.sim.pipeline import build_chain_workers
from hetnode.planning.layer_split import split_layers
from hetnode.training.host_syncs import HostSyncs, optimizer_step_counters
from hetnode.training.stage_worker import Frame, StageWorker

STAGES, MICRO_BATCHES = 3, 5


@pytest.fixture(scope="module")
def config(tiny_config: Config) -> Config:
    config = replace(tiny_config, "data", batch_size=4)
    return replace(config, "inner", grad_clip=1.0)


@pytest.fixture(scope="module")
def dataset(config: Config) -> TokenDataset:
    return TokenDataset.build(config.data, config.model.vocab_size, seed=config.run.seed)


def _workers(config: Config, stages: int = STAGES) -> list[StageWorker]:
    splits = split_layers(config.model.n_layers, [1.0] * stages)
    return build_chain_workers(config, splits, "adamw", compress=True, constrained=True, seed=0)


def _on_host(workers: list[StageWorker]):
    """torch's AdamW keeps its step counters on the host and reads them each step: no wait (see HostSyncs)."""
    counters = [optimizer_step_counters(w.optimizer) for w in workers]
    return lambda t: any(is_counter(t) for is_counter in counters)


def _one_f_one_b(workers: list[StageWorker], batches: list) -> list[torch.Tensor]:
    """The 1F1B schedule of `PipelineChain.run`, calling the workers only; the last stage's losses."""
    last, pending, losses = len(workers) - 1, {}, []
    for cycle in range(len(batches) + last):
        for s, worker in enumerate(workers):
            mb = cycle - s
            if 0 <= mb < len(batches):
                out = worker.forward(mb, batches[mb] if s == 0 else pending.pop((s, mb)))
                if s < last:
                    pending[(s + 1, mb)] = out
                else:
                    losses.append(out)
        mb = cycle - last
        if 0 <= mb < len(batches):
            grad = None
            for s in range(last, -1, -1):
                grad = workers[s].backward(mb, grad)
    return losses


@pytest.mark.parametrize("defer", [True, False], ids=["deferred", "first-stage-reads-its-flag"])
def test_forward_and_backward_read_no_device_value(config, dataset, defer):
    workers = _workers(config)
    workers[0].defer_refusals = defer
    batches = [dataset.train_batch(0, 1, mb) for mb in range(MICRO_BATCHES)]
    with HostSyncs(_on_host(workers)) as syncs:
        losses = _one_f_one_b(workers, batches)
    assert syncs.count == (0 if defer else MICRO_BATCHES)  # the flag: one per first-stage backward
    assert syncs.host_reads > 0  # AdamW's counters were seen and told apart: the count is not vacuous
    assert all(w.version == MICRO_BATCHES for w in workers)
    assert all(isinstance(loss, torch.Tensor) and loss.dim() == 0 for loss in losses)
    with HostSyncs() as read:
        assert workers[-1].last_loss == float(losses[-1]) and math.isfinite(workers[-1].last_loss)
    assert read.count == 3  # two `last_loss` and a `float`: a read only when asked for
    assert workers[0].take_refusals() == 0


def test_a_deferred_refusal_steps_on_a_zero_gradient_and_is_counted(config, dataset):
    """The first stage, deferred: a gradient whose weights' norm overflows (finite on the wire, so only the
    device sees it) never reaches the weights; the step is the one a zero gradient makes, and it is
    counted, read once."""
    attacked, twin = _workers(config, 2)[0], _workers(config, 2)[0]
    attacked.defer_refusals = True
    for worker, scale in ((attacked, 1e30), (twin, 0.0)):
        for mb in range(2):
            frame = worker.forward(mb, dataset.train_batch(0, 1, mb))
            assert isinstance(frame, Frame)
            worker.backward(mb, torch.full_like(frame.tensor, 1e-3))  # honest: optimiser state not empty
        frame = worker.forward(2, dataset.train_batch(0, 1, 2))
        worker.backward(2, torch.full_like(frame.tensor, scale))
    assert attacked.take_refusals() == 1 and attacked.take_refusals() == 0  # read, then reset
    assert twin.take_refusals() == 0
    for a, b in zip(attacked.stage.parameters(), twin.stage.parameters(), strict=True):
        assert torch.isfinite(a).all() and torch.equal(a, b)
    assert attacked.version == twin.version == 3
