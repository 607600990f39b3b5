"""Seeded random tensors that are the same bits on every machine (issue 15: one model on any hardware).

torch's float32 `randn` takes a different kernel path per SIMD capability (`ATEN_CPU_CAPABILITY`
default / avx2 / avx512) and gives other bits on each; its float64 generator does not. So draw in float64,
scale in float64 and round to float32 once: θ⁰ and T_fix are then identical on an old x86, an ARM host or
a GPU host, and a replica that never downloads θ⁰ still starts from the swarm's.
"""

from __future__ import annotations

import torch


def portable_normal(
    shape: tuple[int, ...] | torch.Size,
    generator: torch.Generator,
    std: float,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """Normal(0, std²) samples of `shape`, bit-identical across CPU capabilities (float64, cast once)."""
    return (torch.randn(tuple(shape), generator=generator, dtype=torch.float64) * std).to(dtype)
