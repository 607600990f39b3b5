"""The coordinator's forward passes on a device (`hetnode bootstrap --device`): scoring, evaluation, samples.

θ, the aggregate, the outer step, digests and checkpoints stay on CPU in fp32, which is what keeps a GPU
coordinator's digests equal to a CPU one's (as a GPU anchor's: docs/sync.md). The forwards work on a copy:
θ goes to the device, never back. On CUDA they run in bf16 autocast as the trainer's do
(`hetnode/training/precision.py`); on CPU these helpers hand back what they were given, so the CPU path is
the one every test and digest check was written against.
"""

from __future__ import annotations

import copy
import itertools
import math
from collections.abc import Mapping, Sequence

import torch
from torch import nn

from hetnode.algo.scoring import SparseValues


def model_device(model: nn.Module) -> torch.device:
    return next(model.parameters()).device


def forward_model(model: nn.Module, device: torch.device | str) -> nn.Module:
    """`model` itself on CPU; elsewhere a copy of it on `device` (weights, rotary tables and T_fix, a plain
    attribute that `Module.to` would leave behind), made without a second copy in CPU memory."""
    device = torch.device(device)
    if device.type == "cpu":
        return model
    moved: dict[int, torch.Tensor] = {
        id(p): nn.Parameter(p.detach().to(device), requires_grad=p.requires_grad) for p in model.parameters()
    }
    fixed = getattr(model, "fixed_embedding", None)
    for tensor in itertools.chain(model.buffers(), [fixed] if fixed is not None else []):
        moved[id(tensor)] = tensor.to(device)
    return copy.deepcopy(model, memo=dict(moved))


def on_device(tensors: Mapping[str, torch.Tensor], device: torch.device) -> dict[str, torch.Tensor]:
    """These tensors on `device`: a copy there, or the same tensors where they already are (CPU)."""
    return {name: t.to(device) for name, t in tensors.items()}


def batches_on(batches: Sequence[tuple], device: torch.device) -> list[tuple]:
    return [(inputs.to(device), targets.to(device)) for inputs, targets in batches]


def dense_on(
    update: Mapping[str, SparseValues], shapes: Mapping[str, tuple[int, ...]], device: torch.device
) -> dict[str, torch.Tensor]:
    """`hetnode.algo.scoring.dense_update` made on `device`: only the top-k values travel to it, and they
    are scattered there into dense float32 tensors (on CPU: the same values as `dense_update`)."""
    out = {}
    for name, (indices, values) in update.items():
        dense = torch.zeros(math.prod(shapes[name]), dtype=torch.float32, device=device)
        dense[indices.reshape(-1).to(device).long()] = values.reshape(-1).to(device).float()
        out[name] = dense.reshape(shapes[name])
    return out
