"""A chain stage's faults, for tests and benchmarks only: what it does to the tensor of every activation frame
it sends downstream (`act-…`), every gradient frame it sends upstream (`grad-…`), or both (`frames-…`). Its
own weights and in-flight work stay honest: only the neighbour sees the fault.

- `nan`: one value NaN, `huge`: one value 1e30 (finite in bf16 and fp32, far past every frame bound): the
  receiving stage's wire check refuses both (`hetnode.wire.activation_frame`);
- `signflip`: every value negated, `scaled`: every value ×1e3 (honest frames on tiny stay 2.6·10⁴ times
  below the bounds): valid frames that only their effect on the loss gives away;
- `shape`: one coefficient too many per token: refused for its shape.

`begins_at` (a `time.monotonic()` instant; `hetnode join --fault-after SECONDS`): honest until then, a
worker that turns to lying mid-run."""

from __future__ import annotations

import time

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


class _FrameFault(Faults):
    def __init__(self, fault: str, kind: str, begins_at: float = 0.0) -> None:
        spoiled(fault, torch.zeros(1, 1, 1))  # an unknown fault fails here, not at the first frame
        self.fault, self.name, self.begins_at = fault, f"{kind}-{fault}", begins_at

    def _spoiled(self, tensor: torch.Tensor) -> torch.Tensor:
        return spoiled(self.fault, tensor) if time.monotonic() >= self.begins_at else tensor


class SentActivations(_FrameFault):
    """Spoils every activation frame this stage sends downstream (`act-<fault>`)."""

    def __init__(self, fault: str, begins_at: float = 0.0) -> None:
        super().__init__(fault, "act", begins_at)

    def sent_activations(self, tensor: torch.Tensor) -> torch.Tensor:
        return self._spoiled(tensor)


class SentGradients(_FrameFault):
    """Spoils every gradient frame this stage sends upstream (`grad-<fault>`)."""

    def __init__(self, fault: str, begins_at: float = 0.0) -> None:
        super().__init__(fault, "grad", begins_at)

    def sent_gradients(self, tensor: torch.Tensor) -> torch.Tensor:
        return self._spoiled(tensor)


class SentFrames(_FrameFault):
    """Spoils every frame this stage sends, either way (`frames-<fault>`): a liar at any stage."""

    def __init__(self, fault: str, begins_at: float = 0.0) -> None:
        super().__init__(fault, "frames", begins_at)

    def sent_activations(self, tensor: torch.Tensor) -> torch.Tensor:
        return self._spoiled(tensor)

    def sent_gradients(self, tensor: torch.Tensor) -> torch.Tensor:
        return self._spoiled(tensor)
