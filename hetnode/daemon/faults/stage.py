"""A chain stage's faults, for tests and benchmarks only: what it does to the tensor of every activation frame
it sends downstream (`act-…`), every gradient frame it sends upstream (`grad-…`), or both (`frames-…`). Its
own weights and in-flight work stay honest: only the neighbour sees the fault.

- `nan`: one value NaN, `huge`: one value 1e30 (finite in bf16 and fp32, far past every frame bound): the
  receiving stage's wire check refuses both (`hetnode.wire.activation_frame`);
- `signflip`: every value negated, `scaled`: every value ×1e3 (honest frames on tiny stay 2.6·10⁴ times
  below the bounds): valid frames that only their effect on the loss gives away;
- `shape`: one coefficient too many per token: refused for its shape."""

from __future__ import annotations

import torch

from hetnode.daemon.faults.strategy import Faults

HUGE = 1e30
SCALE = 1e3


def spoiled(fault: str, tensor: torch.Tensor) -> torch.Tensor:
    """`tensor` as a `fault` stage sends it (a new tensor of its dtype; `tensor` is left as it was)."""
    if fault == "signflip":
        return -tensor
    if fault == "scaled":
        return tensor * SCALE
    if fault == "shape":
        return torch.cat([tensor, tensor[..., :1]], dim=-1)
    if fault in ("nan", "huge"):
        out = tensor.clone()
        out.view(-1)[0] = float("nan") if fault == "nan" else HUGE
        return out
    raise ValueError(f"{fault!r} is not a frame fault (nan, huge, signflip, scaled, shape)")


class SentActivations(Faults):
    """Spoils every activation frame this stage sends downstream (`act-<fault>`)."""

    def __init__(self, fault: str) -> None:
        spoiled(fault, torch.zeros(1, 1, 1))  # an unknown fault fails here, not at the first frame
        self.fault, self.name = fault, f"act-{fault}"

    def sent_activations(self, tensor: torch.Tensor) -> torch.Tensor:
        return spoiled(self.fault, tensor)


class SentGradients(Faults):
    """Spoils every gradient frame this stage sends upstream (`grad-<fault>`)."""

    def __init__(self, fault: str) -> None:
        spoiled(fault, torch.zeros(1, 1, 1))
        self.fault, self.name = fault, f"grad-{fault}"

    def sent_gradients(self, tensor: torch.Tensor) -> torch.Tensor:
        return spoiled(self.fault, tensor)


class SentFrames(SentActivations, SentGradients):
    """Spoils every frame this stage sends, either way (`frames-<fault>`): a liar at any stage."""

    def __init__(self, fault: str) -> None:
        SentActivations.__init__(self, fault)
        self.name = f"frames-{fault}"
