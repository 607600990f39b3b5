"""What `hetnode bench chains` concludes from the logs its daemons left: pure functions over the first stage's
`rounds-local.jsonl` lines, the coordinator's `rounds.jsonl` and the status documents read during a run
(tested without a lab). The utilisation benchmark's arithmetic is reused where it applies
(`hetnode/lab/runs/utilization_figures.py`).

Definitions (BENCHMARKS.md says the same):
- the **chain's tokens/s** is its first stage's: Σ tokens / (time_b − start_a) over its measured rounds a..b
  (`replica_figures`: from the first measured round's first micro-batch to the last one's announcement),
  waiting for the seal included. Every micro-batch of the chain passes through the first stage, so its tokens
  are the chain's. Beside it, `train_tokens_per_s` = Σ tokens / Σ train_s: the pace while the chain trains,
  which the anchor's pace does not hold back (a lockstep seal waits for the slower of the two);
- a round's **rate** (the figure's time series) is its tokens over the seconds since the round before it was
  announced (`rate_series`);
- **sealed rounds lost** (a pool worker killed) is the number of rounds sealed after the kill without the
  first stage among the contributors, until the first round sealed with it again (`rounds_without`);
- **boundaries to recover** (a pool worker killed) is (t − t_kill) / `network.boundary_s`, t the announcement
  of the first round after the kill whose rate is at least `share` (0.9) of the reference: the rate of the
  chain with one worker (the one_worker case's tokens/s; the pre-kill rate where that is lower, or where
  one_worker was not measured: with one of two workers left, the chain is back when it runs as a chain
  with one worker runs);
- **rounds lost** (a spare steps in) is the number of rounds sealed after the kill without the first stage
  among the contributors, until the first round sealed with the first stage and the spare together;
- **rounds to drop** (a liar in the pool) is the number of rounds sealed after the fault began and no later
  than the first status read that shows the liar blamed or dropped by its chain (the status is read every
  `status_poll_s`, and the coordinator refreshes what it serves every heartbeat: the count includes that
  lag); **rounds to blame**, the same up to the first stage's log line that blames it (1 s resolution);
- **eval loss against clean** is each run's eval loss, interpolated over its cumulative sealed (credited)
  tokens, at the largest token count both runs reached (`loss_at_equal`).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping, Sequence
from datetime import datetime
from typing import Any

from hetnode.lab.runs.chains_plan import FIRST
from hetnode.lab.runs.utilization_figures import (
    loss_at_equal,
    loss_curve,
    measured,
    p50,
    replica_figures,
)

Record = Mapping[str, Any]
BLAME_LINE = "sent what no honest stage sends"  # hetnode/daemon/chain_links.py, naming the liar first
DAY_S = 86400.0


def first_stage(run: Mapping[str, Any]) -> str:
    """The chain's first stage by name: as the status showed it at its first whole seal, else the planned
    one. The planner puts the fastest candidate first, but a chain formed before it was ready keeps its
    order (a working chain is not re-planned)."""
    chain = run.get("layout_before") or {}
    names = chain.get("names") or []
    return names[0][0] if names and names[0] else FIRST


def sealed_with(entry: Record, peers: Iterable[str]) -> bool:
    """Whether every one of `peers` is among the seal's contributors."""
    return set(peers) <= set(entry.get("contributors") or ())


def first_seal_with(history: Sequence[Record], peers: Iterable[str], after: float = 0.0) -> Record | None:
    """The first seal after `after` (wall clock) with all of `peers` among its contributors."""
    peers = set(peers)
    return next((e for e in history if float(e["time"]) > after and sealed_with(e, peers)), None)


def chain_tokens_per_s(records: Sequence[Record], first_round: int, until: float) -> dict[str, Any]:
    """The chain's figures over its first stage's rounds from `first_round` announced by `until`."""
    rounds = measured(records, first_round, until)
    figures = replica_figures("first stage", "stage", rounds)
    train = figures["train_s"]
    return {
        "tokens_per_s": figures["tokens_per_s"],
        "train_tokens_per_s": figures["tokens"] / train if train > 0 else None,
        "tokens": figures["tokens"],
        "rounds": figures["rounds"],
        "rounds_included": figures["rounds_included"],
        "wall_s": figures["wall_s"],
        "compute_utilization": figures["compute_utilization"],
        # from its announcement to the seal, median: small when the chain is the round's last, large when
        # it waits for the anchor
        "seal_wait_s_p50": p50([float(r.get("seal_wait_s") or 0.0) for r in rounds]),
        "first_round": rounds[0]["round"] if rounds else None,
        "last_round": rounds[-1]["round"] if rounds else None,
    }


def rate_series(records: Sequence[Record], t0: float) -> list[dict[str, float]]:
    """Per round after the first: its tokens over the seconds since the round before was announced, at its
    announcement (seconds since `t0`)."""
    ordered = sorted(records, key=lambda r: float(r["time"]))
    out = []
    for before, record in zip(ordered, ordered[1:], strict=False):
        wall = float(record["time"]) - float(before["time"])
        if wall > 0:
            out.append(
                {
                    "t": float(record["time"]) - t0,
                    "round": int(record["round"]),
                    "tokens_per_s": float(record.get("tokens") or 0) / wall,
                }
            )
    return out


def rounds_without(
    history: Sequence[Record], peer: str, after: float, back_with: Iterable[str]
) -> dict[str, Any]:
    """Rounds sealed after `after` without `peer` among the contributors, until the first seal with all of
    `back_with`: {"lost", "back_round", "back_after_s"}; `back_round` None when it never came back (then
    `lost` counts every later seal)."""
    back = first_seal_with(history, back_with, after)
    until = float(back["time"]) if back is not None else float("inf")
    later = [e for e in history if after < float(e["time"]) < until]
    return {
        "lost": sum(peer not in (e.get("contributors") or ()) for e in later),
        "back_round": back["round"] if back is not None else None,
        "back_after_s": float(back["time"]) - after if back is not None else None,
    }


def recovery(
    records: Sequence[Record],
    killed_at: float,
    reference: float | None,
    boundary_s: float,
    share: float = 0.9,
) -> dict[str, Any]:
    """When the chain's rate is back to `share` × `reference` after a kill at `killed_at`: {"at_round",
    "seconds", "boundaries"} (None when it was not within the records, or without a reference)."""
    none = {"at_round": None, "seconds": None, "boundaries": None, "reference_tokens_per_s": reference}
    if reference is None or reference <= 0:
        return none
    for point in rate_series(records, 0.0):
        if point["t"] > killed_at and point["tokens_per_s"] >= share * reference:
            seconds = point["t"] - killed_at
            return {
                "at_round": point["round"],
                "seconds": seconds,
                "boundaries": seconds / boundary_s,
                "reference_tokens_per_s": reference,
            }
    return none


def rounds_to_drop(history: Sequence[Record], fault_at: float, dropped_at: float | None) -> int | None:
    """Rounds sealed after the fault began (`fault_at`) and no later than the liar was seen dropped."""
    if dropped_at is None:
        return None
    return sum(fault_at < float(e["time"]) <= dropped_at for e in history)


def logged_at(log_text: str, marker: str, near: float) -> float | None:
    """When the first log line holding `marker` was written: its leading HH:MM:SS (the daemons' log format,
    local time) on the day that puts it nearest `near` (wall clock), plus a second (the line was written
    within the second it names: no later than that). None when no line holds it."""
    for line in log_text.splitlines():
        found = re.match(r"(\d\d):(\d\d):(\d\d) ", line) if marker in line else None
        if found is not None:
            hour, minute, second = (int(g) for g in found.groups())
            day = datetime.fromtimestamp(near).replace(hour=hour, minute=minute, second=second, microsecond=0)
            at = day.timestamp()
            return at + DAY_S * round((near - at) / DAY_S) + 1.0
    return None


def rounds_sealed_with(
    history: Sequence[Record], peer: str, after: float, before: float = float("inf")
) -> int:
    return sum(after < float(e["time"]) <= before and peer in (e.get("contributors") or ()) for e in history)


def chain_of(document: Mapping[str, Any] | None, first: str | None = None) -> dict[str, Any] | None:
    """The chain of a status document that `first` leads (any chain when None): a live one before one that
    is not, then the one with the most workers. Its id, lineage, workers per stage, blamed and dropped; None
    when there is none."""
    if not document:
        return None
    chains = [
        c
        for c in document.get("chains") or ()
        if first is None or first in ((c.get("workers") or [[]])[0] or [])
    ]
    if not chains:
        return None
    c = max(chains, key=lambda c: (bool(c.get("live")), sum(len(w) for w in c.get("workers") or ())))
    return {
        "id": c.get("id") or c.get("chain"),
        "live": bool(c.get("live")),
        "lineage": c.get("lineage"),
        "workers": [list(w) for w in c.get("workers") or ()],
        "blamed": list(c.get("blamed") or ()),
        "dropped": dict(c.get("dropped") or {}),
    }


def dropped_by_chain(document: Mapping[str, Any] | None, peer: str) -> bool:
    """Whether some chain of the status document blames `peer` or says it dropped it."""
    chains = (document or {}).get("chains") or ()
    return any(peer in (c.get("blamed") or ()) or peer in (c.get("dropped") or {}) for c in chains)


def eval_against_clean(history: Sequence[Record], clean: Sequence[Record] | None) -> dict[str, Any]:
    """This run's eval loss and the clean run's at the largest sealed-token count both reached."""
    curve = loss_curve(history, 0.0)
    final = curve[-1] if curve else None
    out = {
        "eval_loss_final": final["loss"] if final else None,
        "tokens_final": final["tokens"] if final else None,
        "at_tokens": None,
        "eval_loss": None,
        "eval_loss_clean": None,
        "ratio": None,
    }
    if final is None or not clean:
        return out
    equal = loss_at_equal({"run": curve, "clean": loss_curve(clean, 0.0)}, "tokens")
    loss, clean_loss = equal["loss"]["run"], equal["loss"]["clean"]
    return out | {
        "at_tokens": equal["at"],
        "eval_loss": loss,
        "eval_loss_clean": clean_loss,
        "ratio": loss / clean_loss if loss is not None and clean_loss else None,
    }
