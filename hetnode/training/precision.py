"""Mixed precision for the inner loop: bf16 autocast on CUDA, plain fp32 everywhere else.

Only the forward and backward computation is lowered. Parameters, gradients and the optimiser state stay
fp32 (the master weights), and nothing that a replica publishes is computed under autocast: θ, the
pseudo-gradient, error feedback, the codec, aggregation and the outer step run on CPU in fp32
(`hetnode/daemon/rounds.py`), so a GPU replica's layer digests equal a CPU replica's (docs/sync.md).
bf16 needs no loss scaling (it has fp32's exponent range), unlike fp16.
"""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext

import torch


def autocast_dtype(device: torch.device | str) -> torch.dtype | None:
    """The dtype the forward/backward runs in on `device`; None: no autocast (fp32).

    CPU stays fp32: CPU bf16 kernels are often slower than fp32 ones, and the CPU path is the
    reference every test and digest check is written against."""
    return torch.bfloat16 if torch.device(device).type == "cuda" else None


def autocast_for(device: torch.device | str) -> AbstractContextManager[object]:
    """A context for one forward (and the loss) on `device`; backward runs outside it, as autocast wants."""
    dtype = autocast_dtype(device)
    if dtype is None:
        return nullcontext()
    return torch.autocast(device_type=torch.device(device).type, dtype=dtype)
