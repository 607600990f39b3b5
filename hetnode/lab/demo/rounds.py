"""Pure arithmetic over the coordinator's round history, shared by the live view and the report.

A history entry (`bootstrap/round_keeper.py`; `/api/status` serves the same with counts for lists):
`{round, contributors, tokens, eval_loss, time, payload_bytes: {anchor, stage}, dense_bytes, ...}`.
`payload_bytes` is what the sealed SparseLoCo payloads weighed per replica class; `dense_bytes` what the
same shards would weigh as dense fp32, so their quotient is the compression the round achieved.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class RoundBytes:
    anchor: int
    stage: int
    dense: int  # dense fp32 equivalent of everything sent

    @property
    def sparse(self) -> int:
        return self.anchor + self.stage

    @property
    def ratio(self) -> float | None:
        """How many times smaller than dense fp32 (None when nothing was sent)."""
        return self.dense / self.sparse if self.sparse > 0 and self.dense > 0 else None


def _int(value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        return 0
    return max(0, int(value))


def number(value: Any) -> float | None:
    """A finite float, or None for anything else (JSON null, strings, NaN)."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return float(value) if math.isfinite(value) else None


def round_bytes(entry: Mapping[str, Any]) -> RoundBytes:
    payload = entry.get("payload_bytes")
    payload = payload if isinstance(payload, Mapping) else {}
    return RoundBytes(_int(payload.get("anchor")), _int(payload.get("stage")), _int(entry.get("dense_bytes")))


def contributor_count(entry: Mapping[str, Any]) -> int:
    """`contributors` is a list of peer ids in rounds.jsonl and a count in /api/status."""
    value = entry.get("contributors")
    return len(value) if isinstance(value, list | tuple) else _int(value)


def seconds_per_round(history: Sequence[Mapping[str, Any]]) -> float | None:
    """Mean time between consecutive seals (None before the second one)."""
    times = [t for e in history if (t := number(e.get("time"))) is not None]
    if len(times) < 2 or times[-1] <= times[0]:
        return None
    return (times[-1] - times[0]) / (len(times) - 1)


def eta_s(history: Sequence[Mapping[str, Any]], total: int) -> float | None:
    """Seconds until `total` rounds are sealed, at the pace so far."""
    remaining = total - len(history)
    if remaining <= 0:
        return 0.0
    pace = seconds_per_round(history)
    return None if pace is None else remaining * pace


def human_bytes(value: float | None) -> str:
    if value is None:
        return "–"
    x = float(value)
    for unit in ("B", "KB", "MB", "GB"):
        if abs(x) < 1000 or unit == "GB":
            return f"{x:.0f} {unit}" if unit == "B" else f"{x:.1f} {unit}"
        x /= 1000
    return "–"  # unreachable


def human_seconds(value: float | None) -> str:
    if value is None:
        return "–"
    seconds = max(0, int(round(value)))
    return f"{seconds // 60}:{seconds % 60:02d}" if seconds >= 60 else f"{seconds} s"


def human_ratio(value: float | None) -> str:
    return "–" if value is None else f"{value:,.0f}×"


def loss_text(value: Any) -> str:
    x = number(value)
    return "–" if x is None else f"{x:.3f}"


def swarm_counts(roles: Sequence[str], stages: int) -> dict[str, int]:
    """Peers and replicas from the peers' roles ("anchor" or "stage"; others are not peers of the swarm).
    A chain of `stages` stage peers (its pools' workers included) is one replica (docs/glossary.md):
    replicas = anchors + chains."""
    anchors = sum(role == "anchor" for role in roles)
    edges = sum(role == "stage" for role in roles)
    chains = -(-edges // max(1, stages))
    return {
        "peers": anchors + edges,
        "anchors": anchors,
        "edges": edges,
        "chains": chains,
        "replicas": anchors + chains,
    }


def _n(count: int, word: str) -> str:
    return f"{count} {word}" + ("" if count == 1 else "s")


def replicas_text(counts: Mapping[str, int]) -> str:
    """`3 replicas (2 anchors + 1 chain)`."""
    parts = [_n(counts["anchors"], "anchor")] if counts["anchors"] else []
    parts += [_n(counts["chains"], "chain")] if counts["chains"] else []
    return f"{_n(counts['replicas'], 'replica')} ({' + '.join(parts) or 'none'})"


def span_text(rounds: Sequence[Any]) -> str:
    """`#0–#7` for sealed round numbers in order, `#3` for one, `–` for none."""
    if not rounds:
        return "–"
    return f"#{rounds[0]}" if len(rounds) == 1 else f"#{rounds[0]}–#{rounds[-1]}"
