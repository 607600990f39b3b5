"""The coordinator's round history, `DATA_DIR/rounds.jsonl`: what each reader of that file must merge.

Two kinds of line, one JSON object each, appended in this order:
- the **seal line** of a round, written right after the seal and the commit of θ
  (`bootstrap/round_keeper.py`): `round`, `contributors`, `excluded`, `rejected` (the seal's screens),
  `layer_digests`, `seal_hash`, `seal_seconds`, `time`, `payload_bytes`, `dense_bytes`, `tokens` (the
  sealed contributions' schedule), `credits` (each contributor's row, for a crash before it is credited),
  `evaluated: false`, and `eval_loss`/`sample` as null;
- the **evaluated line** of that round, appended later by the coordinator's bookkeeping worker
  (`bootstrap/bookkeeping.py`) once it has scored, credited and evaluated it: `{"round": t, "evaluated":
  true, ...}` with `rejected` (every verdict: the screens' and the credit refused for a score average),
  `scores`, `verify_seconds`, `tokens` (credited), `eval_loss`, `sample`, and `skipped: true` when the
  worker was behind and left the round's scoring and evaluation out.

`merge_history` folds each evaluated line into the newest seal line of its round, so a merged entry has the
shape one line had before evaluation moved beside the seal. A crash between the two lines leaves the seal
line alone: its digests are there, its evaluation is not.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

HISTORY = "rounds.jsonl"
EVALUATED = "evaluated"  # the key that marks an evaluated line


def is_evaluated_line(row: Mapping[str, Any]) -> bool:
    return row.get(EVALUATED) is True and "contributors" not in row


def merge_history(rows: Iterable[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """One entry per seal line, in file order, each with its round's evaluated line merged in (the newest
    one wins; an evaluated line with no seal line before it is dropped). Rows that are not mappings with
    an integer `round` are skipped, as a torn line is."""
    entries: list[dict[str, Any]] = []
    newest: dict[int, dict[str, Any]] = {}  # round -> its newest seal entry
    for row in rows:
        if not isinstance(row, Mapping) or not isinstance(row.get("round"), int):
            continue
        if is_evaluated_line(row):
            entry = newest.get(row["round"])
            if entry is not None:
                entry.update({k: v for k, v in row.items() if k != "round"})
            continue
        entry = dict(row)
        entries.append(entry)
        newest[entry["round"]] = entry
    return entries
