"""`faults_named`: the strategy a role is handed for a `hetnode join --fault NAME` (None: honest)."""

from __future__ import annotations

from hetnode.daemon.faults import FAULT_NAMES, STAGE_FAULTS
from hetnode.daemon.faults.anchor import Copy, Drift, NanPayloads, PseudoGradientFault, Stale, WrongDigests
from hetnode.daemon.faults.stage import SentActivations, SentFrames, SentGradients
from hetnode.daemon.faults.strategy import HONEST, Faults
from hetnode.training.faults import PSEUDO_GRADIENT_FAULTS

_ANCHOR = {"stale": Stale, "copy": Copy, "nan": NanPayloads, "digest": WrongDigests, "drift": Drift}


def faults_named(name: str | None, begins_at: float = 0.0) -> Faults:
    """A new strategy for fault `name` (a stale anchor's θ history starts empty with each role).
    `begins_at`: a stage's frame faults act from this `time.monotonic()` instant on."""
    if name is None:
        return HONEST
    if name in PSEUDO_GRADIENT_FAULTS:
        return PseudoGradientFault(name)
    if name in _ANCHOR:
        return _ANCHOR[name]()
    if name in STAGE_FAULTS:
        kind, fault = name.split("-", 1)
        return {"act": SentActivations, "grad": SentGradients, "frames": SentFrames}[kind](fault, begins_at)
    raise ValueError(f"unknown fault {name!r}; choose from {', '.join(FAULT_NAMES)}")
