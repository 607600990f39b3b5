"""Count the points where host code waits for a tensor's value (`HostSyncs`).

On a GPU every `.item()`, `float(t)`, `bool(t)` or `if t:` makes the host wait until the device has
finished everything queued before it: the launch queue drains and the GPU idles while Python catches up.
All of them reach torch's `aten._local_scalar_dense`, on CPU as well, so a CPU test counts the syncs the
GPU path would make (patching `Tensor.item` cannot see `bool(tensor)`).
"""

from __future__ import annotations

from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

_READ_SCALAR = torch.ops.aten._local_scalar_dense.default


class HostSyncs(TorchDispatchMode):
    """`with HostSyncs() as syncs: ...` then `syncs.count`: how many tensor values the host read."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        if func is _READ_SCALAR:
            self.count += 1
        return func(*args, **(kwargs or {}))
