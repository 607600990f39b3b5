"""Faults for tests and benchmarks only (`hetnode join --fault NAME`, hidden): one strategy object a role is
handed (`Faults`, honest by default), never flags in the honest loops.

- `strategy.py`: `Faults`, the hooks at every point a fault acts, each honest: it hands back what it is
  given (or does the honest thing the hook stands for), so an honest role pays one call and nothing else;
  and `OldTheta`, the θ a stale anchor trains from;
- `anchor.py`: an anchor's faults: what Δ a round sends (the pseudo-gradient faults of
  `hetnode.training.faults`, without error feedback), the θ a round trains from (stale), the payloads
  announced (copy), the payload bytes (nan), the announced digests (digest), θ after an apply (drift);
- `stage.py`: a chain stage's faults: the activation frame it sends downstream, the gradient frame it sends
  upstream, or both (NaN, huge, wrong sign, wrong scale, wrong shape);
- `factory.py`: `faults_named`, the strategy for a `--fault` name.

The names live here, light: the CLI's parser reads them and must not load torch (`tests/cli`)."""

from __future__ import annotations

from hetnode.training.faults import WORK_FAULTS

HOSTILE_FAULTS = ("nan", "digest")  # payloads no honest peer sends: refused before they count
REPLICA_FAULTS = ("drift",)  # an honest peer's θ gone wrong: the digest check repairs it
FRAME_FAULTS = ("nan", "huge", "signflip", "scaled", "shape")  # what a stage does to each frame it sends
# `frames-…`: both directions, so a test's liar lies at whichever stage the plan gives it
STAGE_FAULTS = tuple(f"{kind}-{fault}" for kind in ("act", "grad", "frames") for fault in FRAME_FAULTS)
ANCHOR_FAULTS = HOSTILE_FAULTS + REPLICA_FAULTS + WORK_FAULTS
FAULT_NAMES = ANCHOR_FAULTS + STAGE_FAULTS
