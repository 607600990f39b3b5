"""What `hetnode bench utilization` concludes from the logs its daemons left: pure functions over each
replica's `rounds-local.jsonl` lines and the coordinator's `rounds.jsonl` (tested without a lab).

Definitions (BENCHMARKS.md says the same):
- a replica's **compute utilisation** over its measured rounds a..b is Σ train_s / (time_b − start_a):
  seconds in inner steps over the wall seconds from the first measured round's first inner step to the
  last one's announcement. `start` is the round's `started_at`, or `time − train_s` in a log written
  before daemons filled `started_at` (in lockstep both are the same moment);
- its **tokens/s** is Σ tokens / the same wall seconds: what it trained per second of the run, waiting
  included (the round log's own `tokens_per_s` is per second of training);
- the **swarm's tokens/s** is the tokens of the sealed rounds after the first measured seal, over the time
  between that seal and the last: tokens the global model took in, each counted once. A seal's tokens are
  those its contributions trained, by the steps it counted (an anchor's steps, a chain stage's as its
  share of the chain: `sealed_tokens`), not the credit: credit is scaled by earned weight and, under paced
  rounds, stops at H steps, so it would undercount the fast replicas' work and a newcomer's;
- **eval loss at equal tokens / wall** is each rule's eval loss interpolated (linearly, between sealed
  rounds) at the largest token count / wall time both rules reached; wall time counts from each run's
  start seal (the first once every replica had trained and synced a round);
- **seal to seal** is the p50 of the seconds between consecutive measured seals.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

Record = Mapping[str, Any]


def round_start(record: Record) -> float:
    """Wall clock at the round's first inner step (`started_at`; `time − train_s` when it is unset)."""
    started = record.get("started_at") or 0.0
    return float(started) if started > 0 else float(record["time"]) - float(record["train_s"])


def utilization(records: Sequence[Record]) -> float | None:
    """Σ train_s / (time_b − start_a) over `records` (one replica's, any order); None below 2 rounds or
    with no wall time between them. At most 1: rounds of one replica never train at the same time."""
    if len(records) < 2:
        return None
    ordered = sorted(records, key=lambda r: r["round"])
    wall = float(ordered[-1]["time"]) - round_start(ordered[0])
    if wall <= 0:
        return None
    return min(1.0, sum(float(r["train_s"]) for r in ordered) / wall)


def measured(records: Iterable[Record], first_round: int, until: float) -> list[Record]:
    """A replica's rounds from `first_round` (the warm-up before it skipped) that it announced by `until`."""
    return sorted(
        (r for r in records if r["round"] >= first_round and float(r["time"]) <= until),
        key=lambda r: r["round"],
    )


def replica_figures(name: str, role: str, records: Sequence[Record]) -> dict[str, Any]:
    """The `replicas[]` entry of utilization.json for one replica's measured rounds."""
    wall = float(records[-1]["time"]) - round_start(records[0]) if len(records) >= 2 else 0.0
    tokens = sum(int(r.get("tokens") or 0) for r in records)
    return {
        "name": name,
        "role": role,
        "compute_utilization": utilization(records),
        "tokens_per_s": tokens / wall if wall > 0 else None,
        "tokens": tokens,
        "inner_steps": [int(r.get("steps") or 0) for r in records],  # per measured round
        "rounds_included": sum(bool(r.get("included")) for r in records),
        "rounds": len(records),
        "train_s": sum(float(r["train_s"]) for r in records),
        "train_wait_s": sum(float(r.get("train_wait_s") or 0.0) for r in records),
        "wall_s": wall,
        "overlap_logged": any(bool(r.get("overlap")) for r in records),
    }


def outside_share(figures: Sequence[Mapping[str, Any]], role: str = "anchor") -> float | None:
    """1 − the median compute utilisation of the replicas of `role`: the share of a round spent outside
    inner steps (in lockstep: announcing, the seal, fetching and applying it, saving the local state);
    what H is chosen by."""
    values = [f["compute_utilization"] for f in figures if f["role"] == role]
    if not values or None in values:
        return None
    return 1.0 - statistics.median(values)


# --- the coordinator's history ---------------------------------------------------------------------------


def start_seal(history: Sequence[Record], logs: Mapping[str, Sequence[Record]]) -> Record | None:
    """The first seal once every replica has trained and synced a round (its first round log line): from
    there all of them run, whether or not each is in every seal (a chain slower than the anchors misses
    seals and catches up; verification may leave work out). None until then."""
    if not logs or not all(logs.values()):
        return None
    ready = max(min(float(r["time"]) for r in records) for records in logs.values())
    return next((e for e in history if float(e["time"]) >= ready), None)


def measured_seals(history: Sequence[Record], first_round: int, until: float) -> list[Record]:
    return [e for e in history if e["round"] >= first_round and float(e["time"]) <= until]


def seal_intervals(seals: Sequence[Record]) -> list[float]:
    times = [float(e["time"]) for e in seals]
    return [b - a for a, b in zip(times, times[1:], strict=False)]


def p50(values: Sequence[float]) -> float | None:
    return statistics.median(values) if values else None


def credited_tokens(entry: Record) -> float:
    return float(entry.get("tokens") or 0)


def sealed_tokens(per_step: int, share: Mapping[str, float]) -> Callable[[Record], float]:
    """A seal's tokens as its contributions trained them: `per_step` tokens (batch × sequence) for each
    step the seal counted, times the contributor's `share` of the model (a chain stage's: 1 / its chain's
    stages; anyone else's: 1). An entry without counted steps: its credited tokens."""

    def tokens(entry: Record) -> float:
        steps = entry.get("steps")
        if not steps:
            return credited_tokens(entry)
        return per_step * sum(n * share.get(peer, 1.0) for peer, n in steps.items())

    return tokens


def swarm_tokens_per_s(
    seals: Sequence[Record], tokens: Callable[[Record], float] = credited_tokens
) -> float | None:
    """Tokens of the seals after the first, over the seconds from the first seal to the last."""
    if len(seals) < 2:
        return None
    wall = float(seals[-1]["time"]) - float(seals[0]["time"])
    return sum(tokens(e) for e in seals[1:]) / wall if wall > 0 else None


def loss_curve(
    history: Sequence[Record], t0: float, tokens_of: Callable[[Record], float] = credited_tokens
) -> list[dict[str, float]]:
    """Per sealed round with an eval loss: wall seconds since `t0`, tokens sealed so far, the loss."""
    out, tokens = [], 0.0
    for entry in history:
        tokens += tokens_of(entry)
        loss = entry.get("eval_loss")
        if isinstance(loss, int | float):
            out.append({"wall_s": float(entry["time"]) - t0, "tokens": float(tokens), "loss": float(loss)})
    return out


def interpolate(points: Sequence[tuple[float, float]], x: float) -> float | None:
    """y at `x` on the polyline through `points` (sorted by x); None outside their range."""
    if not points or x < points[0][0] or x > points[-1][0]:
        return None
    for (x1, y1), (x2, y2) in zip(points, points[1:], strict=False):
        if x1 <= x <= x2:
            return y1 if x2 == x1 else y1 + (y2 - y1) * (x - x1) / (x2 - x1)
    return points[-1][1]


def loss_at_equal(curves: Mapping[str, Sequence[Mapping[str, float]]], axis: str) -> dict[str, Any]:
    """Each rule's eval loss at the same `axis` value ("tokens" or "wall_s"): the largest one every rule
    reached. {"at": x, "loss": {rule: loss}}; "at" None when the rules share no stretch of the axis."""
    lines = {rule: sorted((p[axis], p["loss"]) for p in points) for rule, points in curves.items() if points}
    if len(lines) < len(curves) or not lines:
        return {"at": None, "loss": dict.fromkeys(curves)}
    at = min(line[-1][0] for line in lines.values())
    if at < max(line[0][0] for line in lines.values()):
        return {"at": None, "loss": dict.fromkeys(curves)}
    return {"at": at, "loss": {rule: interpolate(line, at) for rule, line in lines.items()}}


def ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def target(value: float | None, limit: float, holds: bool | None) -> dict[str, Any]:
    """One target's verdict; `holds` None when the value could not be measured."""
    return {"value": value, "limit": limit, "met": None if value is None else bool(holds)}


def judge(rules: Mapping[str, Mapping[str, Any]]) -> tuple[dict[str, Any], dict[str, Any]]:
    """(ratios, targets) of overlap against lockstep, as the issue states the targets."""
    lock, over = rules["lockstep"], rules["overlap"]
    anchors = min_anchor_utilization

    tokens = lock["eval_loss_at_equal_tokens"], over["eval_loss_at_equal_tokens"]
    wall = lock["eval_loss_at_equal_wall"], over["eval_loss_at_equal_wall"]
    seal = over["seal_to_seal_s"], over["seal_to_seal_s_no_verify"]
    ratios = {
        "swarm_tokens_per_s": ratio(over["swarm_tokens_per_s"], lock["swarm_tokens_per_s"]),
        "anchor_utilization": ratio(anchors(over), anchors(lock)),
        "eval_loss_at_equal_tokens": ratio(tokens[1], tokens[0]),
        "eval_loss_at_equal_wall": ratio(wall[1], wall[0]),
        "seal_to_seal_verify_over_no_verify": ratio(*seal),
    }
    digests = sum(int(rule["digest_disagreements"] or 0) for rule in rules.values())
    if "paced+overlap" in rules:  # issue 35: every machine at its own pace
        paced_ratios, paced_targets = judge_paced(rules, anchors)
        ratios |= paced_ratios
    targets = {
        "anchor_utilization_overlap": target(anchors(over), 0.90, (anchors(over) or 0) >= 0.90),
        "swarm_tokens_per_s_ratio": target(
            ratios["swarm_tokens_per_s"], 1.5, (ratios["swarm_tokens_per_s"] or 0) >= 1.5
        ),
        "eval_loss_at_equal_tokens_ratio": target(
            ratios["eval_loss_at_equal_tokens"],
            1.02,
            abs((ratios["eval_loss_at_equal_tokens"] or 0) - 1) <= 0.02,
        ),
        "eval_loss_at_equal_wall_ratio": target(
            ratios["eval_loss_at_equal_wall"], 1.0, (ratios["eval_loss_at_equal_wall"] or 1) < 1.0
        ),
        "seal_to_seal_verify_ratio": target(
            ratios["seal_to_seal_verify_over_no_verify"],
            1.10,
            (ratios["seal_to_seal_verify_over_no_verify"] or 0) <= 1.10,
        ),
        "digest_disagreements": target(float(digests), 0.0, digests == 0),
    }
    if "paced+overlap" in rules:
        targets |= paced_targets
    return ratios, targets


def min_anchor_utilization(rule: Mapping[str, Any]) -> float | None:
    values = [r["compute_utilization"] for r in rule["replicas"] if r["role"] == "anchor"]
    return min(values) if values and None not in values else None


def cap_sweep(rules: Mapping[str, Mapping[str, Any]], cap_ratio: int) -> dict[str, Any]:
    """paced+overlap at each cap that ran (`paced+overlap` at `cap_ratio`, `paced+overlap@<c>H` at c):
    {label: {"cap", "swarm_tokens_per_s_over_overlap", "eval_loss_at_equal_tokens_over_lockstep",
    "eval_loss_at_equal_wall_over_lockstep", "min_anchor_utilization"}}: the trade a cap makes."""
    if "lockstep" not in rules or "overlap" not in rules:
        return {}
    lock, over = rules["lockstep"], rules["overlap"]
    sweep = {}
    for label, rule in rules.items():
        if label == "paced+overlap":
            cap = cap_ratio
        elif label.startswith("paced+overlap@") and label.endswith("H"):
            cap = int(label.removeprefix("paced+overlap@").removesuffix("H"))
        else:
            continue
        sweep[label] = {
            "cap": cap,
            "swarm_tokens_per_s_over_overlap": ratio(rule["swarm_tokens_per_s"], over["swarm_tokens_per_s"]),
            "eval_loss_at_equal_tokens_over_lockstep": ratio(
                rule["eval_loss_at_equal_tokens"], lock["eval_loss_at_equal_tokens"]
            ),
            "eval_loss_at_equal_wall_over_lockstep": ratio(
                rule["eval_loss_at_equal_wall"], lock["eval_loss_at_equal_wall"]
            ),
            "min_anchor_utilization": min_anchor_utilization(rule),
        }
    return dict(sorted(sweep.items(), key=lambda item: item[1]["cap"]))


def judge_paced(
    rules: Mapping[str, Mapping[str, Any]], anchors: Any
) -> tuple[dict[str, Any], dict[str, Any]]:
    """paced+overlap against lockstep and overlap, as issue 35 states the targets: every anchor (the slow
    one included) ≥ 0.90; the slow anchor and the chain in every measured seal; swarm tokens/s ≥ 1.3×
    overlap's; eval loss within 2 % of lockstep's at equal tokens and lower at equal wall time."""
    lock, over, paced = rules["lockstep"], rules["overlap"], rules["paced+overlap"]
    slow = [r["seal_share"] for r in paced["replicas"] if r["name"] == "anchor-3" or r["role"] == "stage"]
    in_every = min(slow) if slow and None not in slow else None
    ratios = {
        "paced_overlap_swarm_tokens_per_s_over_overlap": ratio(
            paced["swarm_tokens_per_s"], over["swarm_tokens_per_s"]
        ),
        "paced_overlap_eval_loss_at_equal_tokens": ratio(
            paced["eval_loss_at_equal_tokens"], lock["eval_loss_at_equal_tokens"]
        ),
        "paced_overlap_eval_loss_at_equal_wall": ratio(
            paced["eval_loss_at_equal_wall"], lock["eval_loss_at_equal_wall"]
        ),
    }
    # the same two once each member was first sealed (its start-up left out): figures, not targets
    since = [r for r in paced["replicas"] if r["name"] == "anchor-3" or r["role"] == "stage"]
    shares = [r.get("seal_share_since_in") for r in since]
    ratios["paced_overlap_slow_anchor_and_chain_seal_share_since_in"] = (
        min(shares) if shares and None not in shares else None
    )
    utils = [r.get("compute_utilization_since_in") for r in paced["replicas"] if r["role"] == "anchor"]
    ratios["paced_overlap_every_anchor_utilization_since_in"] = (
        min(utils) if utils and None not in utils else None
    )
    tokens = ratios["paced_overlap_swarm_tokens_per_s_over_overlap"]
    equal_tokens = ratios["paced_overlap_eval_loss_at_equal_tokens"]
    equal_wall = ratios["paced_overlap_eval_loss_at_equal_wall"]
    targets = {
        "paced_overlap_every_anchor_utilization": target(anchors(paced), 0.90, (anchors(paced) or 0) >= 0.90),
        "paced_overlap_slow_anchor_and_chain_in_every_seal": target(in_every, 1.0, (in_every or 0) >= 1.0),
        "paced_overlap_swarm_tokens_per_s_over_overlap": target(tokens, 1.3, (tokens or 0) >= 1.3),
        "paced_overlap_eval_loss_at_equal_tokens": target(
            equal_tokens, 1.02, abs((equal_tokens or 0) - 1) <= 0.02
        ),
        "paced_overlap_eval_loss_at_equal_wall": target(equal_wall, 1.0, (equal_wall or 1) < 1.0),
    }
    return ratios, targets
