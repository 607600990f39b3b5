"""One JSON line per round this daemon trained and synced (`DATA_DIR/rounds-local.jsonl`): where the time
and the bytes went. The network benchmark reads it; an operator can `tail -f` it."""

from __future__ import annotations

import dataclasses
import json
import time
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

ROUND_LOG = "rounds-local.jsonl"
UTILIZATION_ROUNDS = 8  # the rounds over which a replica's published compute utilisation is read


@dataclass
class RoundRecord:
    round: int
    role: str  # "anchor" or "stage"
    train_s: float  # inner steps (a stage: from its first micro-batch to the end of its drain)
    tokens: int  # tokens this replica trained in the round (a stage: tokens that passed through it)
    upload_bytes: int  # our encoded payload (what the sealer fetched from us)
    download_bytes: int = 0  # sealed payloads we fetched to apply the round
    seal_wait_s: float = 0.0  # from our announcement to seeing the seal
    apply_s: float = 0.0  # fetching, checking and applying the sealed payloads
    fetch_s: float = 0.0  # of apply_s: fetching the sealed payloads we did not hold
    included: bool = True  # our payload is in the seal
    activation_bytes_sent: int = 0  # a stage: frames it sent to its neighbours
    activation_bytes_received: int = 0
    steps: int = 0  # inner steps (a stage: micro-batches) in the round
    loss: float | None = None  # training loss at the end of the round (a stage: only the last one has it)
    # a stage: weight-version delay of its backward passes (updates between a micro-batch's forward and
    # backward; the 1F1B schedule gives P−1−s); None for an anchor
    max_weight_delay: int | None = None
    mean_weight_delay: float | None = None
    # a stage: seconds in its forward/backward passes, and in writing frames to its neighbours (a link
    # slower than the stage's compute shows as send_s: tc shaping blocks the writer once buffers fill)
    compute_s: float | None = None
    send_s: float | None = None
    time: float = field(default_factory=time.time)  # when the record was made: just before announcing
    # wall clock (time.time()) when the round's first inner step began; with `outer.overlap` rounds overlap
    # the previous round's sync, so a replica's compute utilisation over rounds a..b is
    # Σ train_s / (time_b − started_at_a)
    started_at: float = 0.0
    # seconds the training thread stood still in this round: waiting for the round before to be applied
    # (overlap: at most one unapplied round ahead) or, in lockstep, for the seal and apply of the last one
    train_wait_s: float = 0.0
    # an anchor: from its last inner step to its payload ready (compress, encode); with overlap made beside
    # the next round's steps, so it delays the announcement, not the training thread
    close_s: float = 0.0
    overlap: bool = False  # trained under `outer.overlap`
    # a stage before a pool: micro-batches it also sent to a second worker for a second opinion (each
    # worker's `steps` counts those it answered, so the pool's steps are the stage's plus these)
    second_opinions: int = 0

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.train_s if self.train_s > 0 else 0.0


def append_round(data_dir: Path, record: RoundRecord) -> None:
    entry = asdict(record) | {"tokens_per_s": round(record.tokens_per_s, 1)}
    with open(data_dir / ROUND_LOG, "a") as log:
        log.write(json.dumps(entry) + "\n")


def read_rounds(data_dir: Path) -> list[dict]:
    path = data_dir / ROUND_LOG
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def record_from_log(entry: Mapping[str, Any]) -> RoundRecord:
    """A round log line back as a RoundRecord (keys it does not know, e.g. `tokens_per_s`, are dropped)."""
    known = {f.name for f in dataclasses.fields(RoundRecord)}
    return RoundRecord(**{k: v for k, v in entry.items() if k in known})


def rolling_utilization(records: Sequence[RoundRecord], last: int = UTILIZATION_ROUNDS) -> float | None:
    """Compute utilisation over the newest `last` of `records` (one replica's): Σ train_s / (time_b −
    start_a), seconds in inner steps over the wall seconds from the first one's first inner step
    (`started_at`, or `time − train_s` where it was not filled) to the last one's announcement. In
    [0, 1], 3 digits, for the peer record (advice shown to people: nothing decides on it); None below two
    rounds. A gap of rounds the replica did not train (a catch-up) counts as waiting, as it was."""
    window = sorted(records, key=lambda r: r.round)[-last:] if last > 0 else []
    if len(window) < 2:
        return None
    first = window[0]
    start = first.started_at if first.started_at > 0 else first.time - first.train_s
    wall = window[-1].time - start
    if wall <= 0:
        return None
    return round(min(1.0, max(0.0, sum(r.train_s for r in window) / wall)), 3)


def log_utilization(entries: Sequence[Mapping[str, Any]], last: int | None = None) -> float | None:
    """`rolling_utilization` of round log lines (all of them unless `last`); None for lines it cannot
    be read from (written by other code, or without their times)."""
    try:
        records = [record_from_log(entry) for entry in entries]
        return rolling_utilization(records, len(records) if last is None else last)
    except (TypeError, ValueError, AttributeError):
        return None
