"""Fault modes for tests and `hetnode bench trust` (`hetnode join --fault`, hidden): the pseudo-gradient a
hostile or lazy replica would send instead of its honest one (docs/security.md, "Send useless or harmful
work"). Pure math; the strategies a role is handed, these and the protocol-level faults (`stale`: training
from an old θ, `copy`: re-signing another peer's payload, and the rest), are `hetnode/daemon/faults/`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the CLI reads the names below; torch loads only when a fault is applied
    import torch

Params = dict[str, "torch.Tensor"]

# what each fault does to the pseudo-gradient (None: a protocol-level fault)
PSEUDO_GRADIENT_FAULTS = ("noise", "signflip", "scaled", "freerider")
PROTOCOL_FAULTS = ("stale", "copy")
WORK_FAULTS = PSEUDO_GRADIENT_FAULTS + PROTOCOL_FAULTS
FREE_RIDER_SCALE = 1e-3  # a free rider's update: a thousandth of honest work, in a random direction
STALE_ROUNDS = 3  # how far behind a stale replica trains


def corrupt(kind: str, honest: Params, max_value: float, seed: int) -> Params:
    """The pseudo-gradient a `kind` replica sends in place of `honest` (same names and shapes)."""
    import torch

    generator = torch.Generator().manual_seed(seed)
    if kind == "signflip":
        return {n: -t for n, t in honest.items()}
    if kind in ("noise", "freerider"):
        scale = 1.0 if kind == "noise" else FREE_RIDER_SCALE
        out = {}
        for name, t in honest.items():
            noise = torch.randn(t.shape, generator=generator)
            out[name] = noise * (scale * float(t.norm()) / max(float(noise.norm()), 1e-12))
        return out
    if kind == "scaled":
        # as large as the payload bounds allow: the 2-bit table of the largest tile reaches max_value / 4
        peak = max(float(t.abs().max()) for t in honest.values())
        return {n: t * (max_value / 4 / max(peak, 1e-12)) for n, t in honest.items()}
    raise ValueError(f"{kind!r} is not a pseudo-gradient fault ({', '.join(PSEUDO_GRADIENT_FAULTS)})")
