"""Refusing unsafe gradients without reading a device tensor per micro-batch (issue 36).

A stage never steps on, and never sends upstream, a gradient that is not finite or whose weights' norm
the optimiser cannot square in float32: clipping divides by that norm, and Adam's second moment (and the
rotated optimiser's GGᵀ, each entry at most ‖G‖²) accumulates squares of it.

On a GPU every read of a tensor's value makes the host wait for the device, so the checks avoid one:
* the weights' check is a flag on the device (`weights_ok`);
* a stage that sends a gradient upstream folds that flag into it (`fold`: all NaN when refused) and checks
  the host copy the wire needs anyway (`host_finite`, in numpy, which cannot touch a device);
* a gradient that arrived from the wire is on the host already and is checked there the same way.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
import torch

from hetnode.errors import UpdateRefused

FLOAT32_MAX = torch.finfo(torch.float32).max
NORM_LIMIT = FLOAT32_MAX**0.5


def weights_ok(grads: Sequence[torch.Tensor | None]) -> torch.Tensor:
    """A 0-dim bool on the gradients' device: their total norm is finite and squares to a finite float32."""
    norms = [torch.linalg.vector_norm(g, dtype=torch.float32) for g in grads if g is not None]
    if not norms:
        return torch.ones((), dtype=torch.bool)
    total = torch.linalg.vector_norm(torch.stack(norms))
    return total.to(torch.float64) < NORM_LIMIT  # NaN compares False


def fold(ok: torch.Tensor, upstream: torch.Tensor) -> torch.Tensor:
    """`upstream`, or NaN everywhere when the weights' gradients were refused: one host check sees both."""
    return torch.where(ok, upstream, torch.nan)


def host_finite(t: torch.Tensor) -> bool:
    """Every value of a host tensor is finite, decided in numpy (no torch scalar read, no device wait)."""
    if t.device.type != "cpu":
        raise ValueError("host_finite checks host tensors only")
    return bool(np.isfinite(t.detach().to(torch.float32).numpy()).all())


def refusal(mb: int, grads: Sequence[torch.Tensor | None], upstream: bool = False) -> UpdateRefused:
    """The error for a refused micro-batch (the rare path: reading the norm here costs nothing)."""
    norms = [float(torch.linalg.vector_norm(g, dtype=torch.float32)) for g in grads if g is not None]
    total = math.sqrt(sum(n * n for n in norms)) if all(math.isfinite(n) for n in norms) else math.nan
    if upstream and total < NORM_LIMIT:
        return UpdateRefused(f"micro-batch {mb}: the gradient for the previous stage is not finite")
    return UpdateRefused(f"micro-batch {mb}: gradient norm {total:.3g} is not finite or too large")


def agreement(a: torch.Tensor, b: torch.Tensor) -> float:
    """The cosine between two workers' gradients for one micro-batch (host tensors off the wire), in
    float32: near 1 for two honest workers of a pool, negative when one flipped its sign
    (`planning.routing.AGREE_COS`); −1 when either has no finite, non-zero norm."""
    x, y = a.reshape(-1).float(), b.reshape(-1).float()
    norms = float(torch.linalg.vector_norm(x) * torch.linalg.vector_norm(y))
    return float(torch.dot(x, y)) / norms if norms > 0 and math.isfinite(norms) else -1.0


def norm_ratio(a: torch.Tensor, b: torch.Tensor) -> float:
    """How many times the larger of two gradients' norms is the smaller's (inf when one is zero or not
    finite)."""
    x, y = float(torch.linalg.vector_norm(a.float())), float(torch.linalg.vector_norm(b.float()))
    low, high = min(x, y), max(x, y)
    return high / low if low > 0 and math.isfinite(high) else math.inf
