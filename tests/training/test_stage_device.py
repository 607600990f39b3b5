"""A stage trains on its device: weights, U and T_fix there once; batches and frames arrive on the host and
frames leave it on the host (the wire's copy); θ, error feedback and the payload stay on the CPU."""

from __future__ import annotations

import pytest
import torch

from hetnode.daemon.stage_training import StageTraining, stage_part
from hetnode.data.dataset import TokenDataset
from hetnode.replica.global_model import GlobalModel
from hetnode.training.stage_worker import Frame

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def _chain(config, device: str):
    n = config.model.n_layers
    splits = (range(0, n // 2), range(n // 2, n))
    dataset = TokenDataset.build(config.data, config.model.vocab_size, config.run.seed)
    stages = [
        StageTraining(config, splits, i, "chain-d", dataset if i == 0 else None, device=device)
        for i in range(2)
    ]
    for i, stage in enumerate(stages):
        stage.rebase(stage.rebase_from(GlobalModel(config, part=stage_part(splits, i, True))))
    stages[0].begin_round(0)
    stages[1].begin_round(0, stages[0].drift_base)
    return stages


def _round(stages, micro_batches: int) -> list[float]:
    first, last = stages
    losses = []
    for _ in range(micro_batches):
        mb, batch = first.next_batch()
        frame = first.forward(mb, batch)
        assert isinstance(frame, Frame) and frame.tensor.device.type == "cpu"  # the wire's host copy
        assert frame.tokens.device.type == "cpu"
        loss = last.forward(mb, frame)
        grad = last.backward(mb)
        assert grad is not None and grad.device.type == "cpu"
        first.backward(mb, grad)
        losses.append(float(loss))
    return losses


@pytest.mark.parametrize("device", DEVICES)
def test_a_stage_keeps_its_tensors_on_its_device_and_hands_the_wire_host_tensors(tiny_config, device):
    stages = _chain(tiny_config, device)
    for stage in stages:
        worker = stage.worker
        assert {p.device.type for p in worker.stage.parameters()} == {device}
        assert worker.constraint.basis.device.type == device and worker.constraint.fixed.device.type == device
    assert stages[0].worker.stage.fixed_embedding.device.type == device
    losses = _round(stages, 3)
    assert all(torch.isfinite(torch.tensor(losses)))
    payloads = [stage.end_round(0, "peer-d") for stage in stages]
    assert all(payloads) and all(isinstance(b, bytes) for p in payloads for b in p.values())
    assert stages[0].local.theta["embed.weight"].device.type == "cpu"  # θ stays on the CPU


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU: checked by benchmarks/gpu_check.sh")
def test_a_gpu_chain_learns_as_the_cpu_chain_does(tiny_config):
    cpu, gpu = _round(_chain(tiny_config, "cpu"), 4), _round(_chain(tiny_config, "cuda"), 4)
    assert cpu[0] == pytest.approx(gpu[0], rel=0.02)  # the same start, bf16 autocast on the GPU
    assert gpu[-1] < gpu[0] * 1.05
