"""Count the points where host code waits for a tensor's value (`HostSyncs`).

On a GPU every `.item()`, `float(t)`, `bool(t)` or `if t:` makes the host wait until the device has
finished everything queued before it: the launch queue drains and the GPU idles while Python catches up.
All of them reach torch's `aten._local_scalar_dense`, on CPU as well, so a CPU test counts the syncs the
GPU path would make (patching `Tensor.item` cannot see `bool(tensor)`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

_READ_SCALAR = torch.ops.aten._local_scalar_dense.default


class HostSyncs(TorchDispatchMode):
    """`with HostSyncs() as syncs: ...` then `syncs.count`: how many tensor values the host read.

    `host_side`: which tensors live on the host whatever the device (reading them waits for nothing on
    a GPU either); their reads are counted apart, in `host_reads`. See `optimizer_step_counters`."""

    def __init__(self, host_side: Callable[[torch.Tensor], bool] | None = None) -> None:
        super().__init__()
        self.count = 0
        self.host_reads = 0
        self.host_side = host_side

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        if func is _READ_SCALAR:
            if self.host_side is not None and self.host_side(args[0]):
                self.host_reads += 1
            else:
                self.count += 1
        return func(*args, **(kwargs or {}))


def optimizer_step_counters(optimizer: torch.optim.Optimizer) -> Callable[[torch.Tensor], bool]:
    """Whether a tensor is one of `optimizer`'s step counters. torch's Adam family without `capturable`
    or `fused` keeps `state["step"]` on the CPU even for a GPU's parameters and reads it each step: a read
    on the host, not a wait for the device (on a CPU test both look alike)."""

    def is_counter(tensor: torch.Tensor) -> bool:
        return any(tensor is state.get("step") for state in optimizer.state.values())

    return is_counter
