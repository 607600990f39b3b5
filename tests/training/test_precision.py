"""Mixed precision: bf16 autocast only on CUDA, fp32 master weights, and nothing a replica publishes computed
in bf16 or off the CPU. The bf16 path is exercised on CPU (CPU autocast) since CI has no GPU."""

import warnings
from contextlib import nullcontext

import pytest
import torch

from hetnode.config import Config, replace
from hetnode.daemon.rounds import AnchorTraining
from hetnode.data import TokenDataset
from hetnode.model import build_model
from hetnode.replica.global_model import GlobalModel
from hetnode.training.local_rounds import LocalRounds
from hetnode.training.precision import autocast_dtype, autocast_for
from hetnode.training.trainer import InnerTrainer


@pytest.fixture(scope="module")
def dataset(tiny_config: Config) -> TokenDataset:
    return TokenDataset.build(tiny_config.data, tiny_config.model.vocab_size, seed=tiny_config.run.seed)


@pytest.fixture
def cpu_bf16(monkeypatch: pytest.MonkeyPatch) -> None:
    """Make the trainer autocast on CPU as it would on CUDA."""
    monkeypatch.setattr(
        "hetnode.training.trainer.autocast_for", lambda device: torch.autocast("cpu", dtype=torch.bfloat16)
    )


@pytest.mark.parametrize(
    ("device", "expected"),
    [("cpu", None), (torch.device("cpu"), None), ("cuda", torch.bfloat16), ("cuda:0", torch.bfloat16)],
)
def test_only_cuda_autocasts_and_in_bf16(device, expected):
    assert autocast_dtype(device) == expected


def test_cpu_context_is_a_no_op_and_cuda_context_is_bf16_autocast():
    assert isinstance(autocast_for("cpu"), nullcontext)
    with warnings.catch_warnings():  # a CPU-only build warns that CUDA autocast would be disabled
        warnings.simplefilter("ignore")
        context = autocast_for("cuda")
    assert isinstance(context, torch.autocast)
    assert context.device == "cuda" and context.fast_dtype == torch.bfloat16


def test_bf16_steps_keep_fp32_master_weights(tiny_config: Config, dataset: TokenDataset, cpu_bf16):
    fp32 = InnerTrainer(tiny_config, build_model(tiny_config.model, seed=0), dataset)
    bf16 = InnerTrainer(tiny_config, build_model(tiny_config.model, seed=0), dataset)
    with torch.no_grad():  # the reference trainer runs without autocast
        reference = fp32.model.loss(*dataset.train_batch(0, 1, 0)).item()
    first = bf16.train_step().loss
    assert first == pytest.approx(reference, abs=0.05)  # same batch, same init: only rounding differs
    losses = [bf16.train_step().loss for _ in range(7)]
    assert all(torch.isfinite(torch.tensor(losses)))
    assert losses[-1] < first  # it learns
    for param in bf16.model.parameters():
        assert param.dtype == torch.float32 and param.grad.dtype == torch.float32
    for state in bf16.optimizer.state.values():
        assert all(v.dtype == torch.float32 for v in state.values() if v.is_floating_point())


def test_anchor_payload_is_computed_on_cpu_fp32_from_a_bf16_trained_replica(
    tiny_config: Config, dataset: TokenDataset, cpu_bf16, monkeypatch: pytest.MonkeyPatch
):
    config = replace(tiny_config, "outer", inner_steps=3)
    seen: list[torch.Tensor] = []
    original = LocalRounds.pseudo_gradient

    def spy(self):
        delta = original(self)
        seen.extend([*self.start.values(), *delta.values()])
        return delta

    monkeypatch.setattr(LocalRounds, "pseudo_gradient", spy)
    coordinator, replica = GlobalModel(config), GlobalModel(config)
    anchor = AnchorTraining(config, dataset, "peer-gpu-like")
    payload = anchor.run_round(0, replica)
    assert seen and all(t.device.type == "cpu" and t.dtype == torch.float32 for t in seen)
    buffers = anchor.feedback.buffers.values()
    assert buffers and all(b.device.type == "cpu" and b.dtype == torch.float32 for b in buffers)
    for model in (coordinator, replica):
        model.apply(0, [("peer-gpu-like", payload)])
        assert all(p.device.type == "cpu" and p.dtype == torch.float32 for p in model.params.values())
    assert coordinator.digests() == replica.digests()
