"""What `hetnode bench soak` concludes from what it recorded: pure functions over the coordinator's history,
replicas' status documents, the ledger's rows, round logs and resource samples (tested without a lab).

Definitions (docs/lab.md says the same):
- a **digest disagreement** is a replica whose layer digests for the round it reports differ from the
  coordinator's record of that round (a stage: for the layers it holds);
- a **half-applied round** is a disagreement in which every layer matches *some* sealed round but not all the
  same one: a replica that applied part of a round;
- a **ledger mismatch** is a sealed round whose credited peers differ from its contributors (less those the
  seal refused), or a credited round the history does not have.
"""

from __future__ import annotations

import statistics
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

SECONDS_PER_HOUR = 3600.0


@dataclass(frozen=True)
class DigestCheck:
    replica: str
    params_round: int
    verdict: str  # "agrees", "disagrees", "half-applied" or "unknown-round"


def check_digests(
    peers: Iterable[Mapping[str, Any]], history: Sequence[Mapping[str, Any]]
) -> list[DigestCheck]:
    """Each anchor's and stage's digests (from `hetnode status --json`) against the history's."""
    by_round = {entry["round"]: entry["layer_digests"] for entry in history if entry.get("layer_digests")}
    out = []
    for peer in peers:
        if peer.get("role") not in ("anchor", "stage") or peer.get("params_round") is None:
            continue
        held: Mapping[str, str] = peer.get("layer_digests") or {}
        round_ = int(peer["params_round"])
        theirs = by_round.get(round_)
        if theirs is None:
            out.append(DigestCheck(peer["name"], round_, "unknown-round"))
            continue
        if held and all(theirs.get(shard) == digest for shard, digest in held.items()):
            out.append(DigestCheck(peer["name"], round_, "agrees"))
            continue
        # every shard a sealed round's, just not one round's: part of a round applied
        known = [{r for r, d in by_round.items() if d.get(shard) == digest} for shard, digest in held.items()]
        mixed = bool(held) and all(known) and not set.intersection(*known)
        out.append(DigestCheck(peer["name"], round_, "half-applied" if mixed else "disagrees"))
    return out


def ledger_mismatches(
    history: Sequence[Mapping[str, Any]], credited: Mapping[int, set[str]]
) -> list[dict[str, Any]]:
    """Rounds where the ledger's credited peers differ from the sealed contributors (less refused peers)."""
    out = []
    sealed = {entry["round"]: entry for entry in history}
    for round_, entry in sealed.items():
        expected = set(entry["contributors"]) - set(entry.get("rejected", {}))
        got = credited.get(round_, set())
        if got != expected:
            out.append({"round": round_, "missing": sorted(expected - got), "extra": sorted(got - expected)})
    for round_ in sorted(set(credited) - set(sealed)):
        out.append({"round": round_, "missing": [], "extra": sorted(credited[round_]), "unsealed": True})
    return out


def slope_per_hour(samples: Sequence[tuple[float, float]]) -> float | None:
    """The Theil-Sen slope of (time s, value) pairs, per hour: the median of the slopes between every two
    samples. A leak moves every pair; a transient (a stream's fds open for a minute, a peak of RSS while a
    round is applied) moves few, so it does not read as growth as it would in a least-squares fit. None
    with fewer than 3 samples."""
    if len(samples) < 3:
        return None
    slopes = sorted(
        (v2 - v1) / (t2 - t1) for i, (t1, v1) in enumerate(samples) for t2, v2 in samples[i + 1 :] if t2 != t1
    )
    if not slopes:
        return None
    return statistics.median(slopes) * SECONDS_PER_HOUR


def growth_per_hour(samples: Sequence[tuple[float, float]]) -> float | None:
    """The slope as a share of the mean level (0.05: 5 % per hour)."""
    slope = slope_per_hour(samples)
    level = statistics.fmean(v for _, v in samples) if samples else 0.0
    return None if slope is None or level <= 0 else slope / level


def steady_stretch(
    rss: Sequence[tuple[float, float]],
    fds: Sequence[tuple[float, float]],
    changes: Sequence[float],
    warmup_s: float,
    min_span_s: float,
) -> tuple[list[tuple[float, float]], list[tuple[float, float]]]:
    """The samples of a daemon's life (time, value) on its longest stretch between role changes
    (`changes`; the life's start is one too), less each stretch's first `warmup_s`; both lists empty
    when that stretch spans less than `min_span_s` (too short to tell a slope from noise)."""
    if not rss:
        return [], []
    born, end = rss[0][0], rss[-1][0]
    starts = sorted({born, *(t for t in changes if born < t <= end)})
    best: tuple[float, float] | None = None
    for start, stop in zip(starts, [*starts[1:], float("inf")], strict=True):
        kept = [t for t, _ in rss if start + warmup_s <= t < stop]
        if kept and (best is None or kept[-1] - kept[0] > best[1] - best[0]):
            best = (kept[0], kept[-1])
    if best is None or best[1] - best[0] < min_span_s:
        return [], []
    return (
        [s for s in rss if best[0] <= s[0] <= best[1]],
        [s for s in fds if best[0] <= s[0] <= best[1]],
    )


def catch_up_rounds(records: Sequence[Mapping[str, Any]], back_at: float, sealed_then: int) -> int | None:
    """Rounds sealed between a peer's return (`back_at`, when the swarm had sealed `sealed_then`) and the
    swarm's θ in its hands: its first round log record after `back_at` for a round past `sealed_then` is
    for round r, trained on θ after r - 1 (a record of an earlier round was trained before it left). None
    if it never trained again."""
    after = [r for r in records if r.get("time", 0.0) >= back_at and r["round"] > sealed_then]
    if not after:
        return None
    return max(0, min(r["round"] for r in after) - 1 - sealed_then)


def contributing_rounds(records: Sequence[Mapping[str, Any]], back_at: float, sealed_then: int) -> int | None:
    """Rounds between a peer's return and its first round in a seal (the round it trains in after catching
    up is one of them); None if it never contributed again."""
    after = [r for r in records if r.get("time", 0.0) >= back_at and r.get("included")]
    if not after:
        return None
    return max(0, min(r["round"] for r in after) - sealed_then)


def boundaries_to_reform(died_at: float, live_at: Sequence[float], boundary_s: float) -> float | None:
    """Boundaries from a chain member's death to the first moment a chain is live again (`live_at`: the
    times surviving or spare stages reported a chain live); None if none did."""
    after = sorted(t for t in live_at if t > died_at)
    return None if not after else (after[0] - died_at) / boundary_s


def round_times(history: Sequence[Mapping[str, Any]]) -> list[float]:
    """Seconds between consecutive sealed rounds."""
    times = [entry["time"] for entry in history]
    return [b - a for a, b in zip(times, times[1:], strict=False)]


def quantiles(values: Sequence[float]) -> dict[str, float] | None:
    if not values:
        return None
    ordered = sorted(values)
    pick = lambda q: ordered[min(len(ordered) - 1, int(q * len(ordered)))]  # noqa: E731 - a local shorthand
    return {"p10": pick(0.1), "p50": pick(0.5), "p90": pick(0.9), "max": ordered[-1], "n": len(ordered)}
