"""Seals as a chain (docs/security.md, "Who is trusted with what"): each seal names the hash of the one before
it, and a replica takes a seal only from a sealer the manifest allows and only as the next link after the
round it holds. A far-future
seal, a fork or a replay is refused on sight; `seal_verdict` says what to do with one."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Collection
from typing import Any, Literal

GENESIS = ""  # the `prev` of round 0's seal
# the most weight one contribution may carry in a seal (earned by verified history; the aggregate's bound,
# `hetnode.algo.aggregation_rules.MAX_WEIGHT`, is the same number)
MAX_SEAL_WEIGHT = 1024

Verdict = Literal["apply", "old", "behind", "fork", "not_allowed"]


def seal_digest(record: dict[str, Any]) -> str:
    """sha256 of a seal record in canonical JSON (sorted keys): what the next seal names as `prev`."""
    canonical = json.dumps(record, sort_keys=True, separators=(",", ":"), allow_nan=False)
    return hashlib.sha256(canonical.encode()).hexdigest()


def seal_verdict(
    record: dict[str, Any], sealer: str, allowed: Collection[str], held_round: int, held_hash: str | None
) -> Verdict:
    """What a replica holding θ after `held_round` (reached by the seal `held_hash`; None when unknown,
    e.g. an old local state) does with `record` from `sealer`:
    apply (the next link), old (a round it holds), behind (it missed rounds: catch up from the
    coordinator), fork (the right round, another chain: catch up), not_allowed (ignore the sealer)."""
    if sealer not in allowed:
        return "not_allowed"
    round_ = record.get("round")
    if not isinstance(round_, int) or round_ <= held_round:
        return "old"
    if round_ > held_round + 1:
        return "behind"
    if held_hash is not None and record.get("prev") != held_hash:
        return "fork"
    return "apply"
