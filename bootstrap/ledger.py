"""The contribution ledger: tokens credited per peer, one row per (sealed round, peer), in SQLite.

Credit is granted only for contributions in sealed rounds (docs/sync.md, "Rounds over the network"), so the
coordinator records a round once it is sealed and the leaderboard matches what each peer's own round log says.
Rows are keyed by (round, peer) and written with `INSERT OR IGNORE`: replaying a round after a restart never
double-counts.

The credit rule (`credited_tokens`, stated for users in docs/observability.md, "Contribution credit"): a
sealed contribution earns its replica's tokens by the manifest's schedule (H x batch x seq); a chain stage
earns the part of its chain's tokens in proportion to the parameters of the shards it delivered, so a
chain's stages together earn exactly one replica's tokens. Each row keeps both numbers: `tokens` (credited)
and `replica_tokens` (what its replica trained: for a stage, the whole chain's tokens).

The ledger defends itself whatever its caller passes (docs/security.md, "Who is trusted with what";
docs/security.md, "Exhaust a daemon"):
- every number written is an int (not a bool) in [0, MAX_COUNT]; a bad row refuses the whole round with a
  `LedgerError` naming the field and the peer;
- sums use SQL `total()` (a float, which cannot overflow) over values in that range: each term is a
  non-negative int, so while the result is below 2**53 every partial sum is an exactly representable
  integer and the answer is exact (2**53 ~ 9e15 tokens: over 100x the largest training runs to date);
  above it the answer is a float's approximation, never an error. A row outside the range (a database
  written before these bounds) counts as 0 and is reported once at open: old poison cannot fail a route;
- connections are bounded whatever the number of threads: one writer connection behind a lock (SQLite
  admits one writer at a time anyway, and the sealing loop never waits behind HTTP readers for a
  connection) and a pool of at most `max_connections - 1` reader connections, lent for one query each.
  A pool rather than one shared reader: in WAL mode readers run in parallel and never block the writer.
`LedgerCollector` turns the standings into per-peer Prometheus series at scrape time (per-peer labels are
allowed on the coordinator only, STYLE.md).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
import re
import sqlite3
import threading
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from bootstrap.earned_weight import STRIKE_SCORE
from hetnode.errors import HetnodeError

log = logging.getLogger(__name__)

# 2: verdicts (scores and rejections of contributions, docs/security.md, "Send useless or harmful work"); 3:
# contributions.replica_tokens; 4: verdicts.weight (the weight a peer has earned by verified history,
# `bootstrap/earned_weight.py`)
SCHEMA_VERSION = 4
# why a contribution got no weight or credit ("probation": its author has no verified round yet)
REASONS = ("stale", "copy", "norm", "score", "probation")
MAX_VERDICTS_SHOWN = 200
BUSY_TIMEOUT_S = 10.0
MAX_CONNECTIONS = 8  # one writer + 7 readers: a status page needs a few, each query takes milliseconds
MAX_PEER_CHARS = 128
MAX_NAME_CHARS = 64
MAX_ROLE_CHARS = 64
MAX_INT = 2**63 - 1  # SQLite INTEGER; the bound on round numbers
# Per contribution: tokens, inner steps and payload bytes. 2**40 (~1.1e12) is over 1000x one replica's
# round (H x batch x seq ~ 5e8 tokens at H=500, 512 x 2048) and a TiB of payload.
MAX_COUNT = 2**40
COUNT_FIELDS = ("tokens", "inner_steps", "bytes_sent")
_SURROGATE = re.compile("[\ud800-\udfff]")

_SCHEMA = """
CREATE TABLE IF NOT EXISTS contributions (
    round INTEGER NOT NULL,
    peer TEXT NOT NULL,
    name TEXT NOT NULL,
    role TEXT NOT NULL,
    tokens INTEGER NOT NULL,
    inner_steps INTEGER NOT NULL,
    bytes_sent INTEGER NOT NULL,
    sealed_at REAL NOT NULL,
    replica_tokens INTEGER,
    PRIMARY KEY (round, peer)
);
CREATE INDEX IF NOT EXISTS contributions_by_peer ON contributions (peer, round);
CREATE TABLE IF NOT EXISTS verdicts (
    round INTEGER NOT NULL,
    peer TEXT NOT NULL,
    reason TEXT,
    score REAL,
    average REAL,
    weight INTEGER,
    PRIMARY KEY (round, peer)
);
CREATE INDEX IF NOT EXISTS verdicts_by_peer ON verdicts (peer, round);
"""
# each peer's newest verdict (its score average now) and how many of its contributions were rejected
_SCORES = """
SELECT v.peer, v.average, v.reason, r.rejected FROM verdicts AS v
JOIN (SELECT peer, MAX(round) AS last, total(reason IS NOT NULL) AS rejected FROM verdicts GROUP BY peer) AS r
  ON v.peer = r.peer AND v.round = r.last
"""
_REJECTIONS = "SELECT reason, COUNT(*) FROM verdicts WHERE reason IS NOT NULL GROUP BY reason"
# what the verifier knew of each peer after its newest verdict: its average, how many scores are behind
# it and the weight it had earned (a restarted coordinator takes them up again)
_STANDING = """
SELECT v.peer, v.average, r.scored, v.weight, r.strikes FROM verdicts AS v
JOIN (
  SELECT peer, MAX(round) AS last, COUNT(score) AS scored, COUNT(CASE WHEN score < ? THEN 1 END) AS strikes
  FROM verdicts GROUP BY peer
) AS r
  ON v.peer = r.peer AND v.round = r.last
"""


def _valid(column: str) -> str:
    return f"(typeof({column}) = 'integer' AND {column} BETWEEN 0 AND {MAX_COUNT})"


def _credit(column: str) -> str:
    """A column's value where it is within the schema's bounds, else 0 (see the module docstring)."""
    return f"CASE WHEN {_valid(column)} THEN {column} ELSE 0 END"


# a row's replica tokens; rows written before schema 3 (NULL) held an anchor's or a stage's own tokens
_REPLICA_TOKENS = (
    f"CASE WHEN replica_tokens IS NULL THEN {_credit('tokens')} ELSE {_credit('replica_tokens')} END"
)
# Per-peer sums, with name and role taken from the peer's latest round (the row at MAX(round)).
_STANDINGS = f"""
WITH per_peer AS (
    SELECT peer, total({_credit("tokens")}) AS tokens, total({_REPLICA_TOKENS}) AS replica_tokens,
           COUNT(*) AS rounds,
           total({_credit("inner_steps")}) AS inner_steps, total({_credit("bytes_sent")}) AS bytes_sent,
           MAX(round) AS last_round, MAX(sealed_at) AS last_seen
    FROM contributions GROUP BY peer
)
SELECT p.peer, c.name, c.role, p.tokens, p.replica_tokens, p.rounds, p.inner_steps, p.bytes_sent,
       p.last_round, p.last_seen
FROM per_peer AS p JOIN contributions AS c ON c.peer = p.peer AND c.round = p.last_round
ORDER BY p.tokens DESC, c.name, p.peer
"""
_TOTALS = f"SELECT total({_credit('tokens')}), COUNT(DISTINCT round), COUNT(*) FROM contributions"
_OUT_OF_BOUNDS = "SELECT COUNT(*) FROM contributions WHERE NOT ({})".format(
    " AND ".join(_valid(field) for field in COUNT_FIELDS)
)


class LedgerError(HetnodeError, ValueError):
    """A contribution failed validation (`field` names the part at fault, `peer` whose), or the ledger
    cannot be used."""

    def __init__(self, field: str, message: str, peer: str | None = None) -> None:
        self.field = field
        self.message = message
        self.peer = peer
        super().__init__(f"{field}: {message}")


@dataclass(frozen=True)
class Contribution:
    """One peer's sealed contribution to one round: `tokens` credited (`credited_tokens`), and
    `replica_tokens` its replica trained (a stage: its chain's; None: the same as `tokens`, an anchor)."""

    peer: str
    name: str
    role: str
    tokens: int
    inner_steps: int
    bytes_sent: int
    replica_tokens: int | None = None

    @property
    def trained(self) -> int:
        return self.tokens if self.replica_tokens is None else self.replica_tokens


def shard_tokens(schedule: int, sizes: Sequence[tuple[str, int]]) -> dict[str, int]:
    """One replica's `schedule` tokens split over the model's shards, given in model order with their
    parameter counts, in proportion to those counts. Integers by cumulative rounding, so the shares of any
    set of shards never exceed `schedule` and the shares of all of them add up to exactly `schedule`."""
    total = sum(max(0, size) for _, size in sizes)
    if schedule < 0 or total <= 0:
        raise LedgerError("schedule", f"cannot split {schedule} tokens over {total} parameters")
    out, before = {}, 0
    for shard, size in sizes:
        after = before + max(0, size)
        out[shard] = schedule * after // total - schedule * before // total
        before = after
    return out


def credited_tokens(per_shard: Mapping[str, int], shards: Iterable[str]) -> int:
    """THE credit rule for one sealed contribution: the tokens of the shards it delivered (`shard_tokens`).
    An anchor delivers every shard and earns one replica's schedule; a chain's stages, whose shards
    partition the model, earn exactly one replica's schedule between them, each in proportion to the
    parameters it trained. Unknown shard names earn nothing (the seal admits only the model's)."""
    return sum(per_shard.get(shard, 0) for shard in set(shards))


def credit_round(
    schedule: int,
    sizes: Sequence[tuple[str, int]],
    inner_steps: int,
    contributions: Iterable[tuple[str, Mapping[str, bytes]]],
    names: Mapping[str, str],
    weights: Mapping[str, int] | None = None,
    full_weight: int = 1,
    steps: Mapping[str, int] | None = None,
    stages: Mapping[str, tuple[str, int]] | None = None,
    served: Mapping[str, int] | None = None,
) -> list[Contribution]:
    """The ledger rows of one sealed round, from the protocol alone: `schedule` tokens per replica (H x
    batch x seq), the model's shards in order with their parameter counts (`sizes`), and each sealed
    contribution's payloads by shard. Credit goes with weight: a contribution of weight w out of
    `full_weight` earns w / full_weight of its tokens (a newcomer's credit grows with its verified
    history, as its weight does; `weights` None: full weight each). Paced rounds (`steps`: the sealed
    steps per contribution, within the cap) scale a replica's schedule by its steps over H; otherwise
    claimed tokens and steps play no part. `names` (display names from the peers' records) are advice and
    earn nothing.

    Stage pools (`stages`: each chain member's (chain, stage); several sealed ones on one stage are its
    pool): the stage earns what a lone stage would, split among its workers by the micro-batches each
    served (`served`: the sealed steps, verified where paced; None: `steps`, else equal shares). Under
    paced rounds the stage's steps are its chain's count, the fewest its stages served between their
    workers (within H)."""
    per_step = schedule // max(1, inner_steps)
    whole = {shard for shard, _ in sizes}
    contributions = list(contributions)
    served = served if served is not None else steps or {}

    def share(peer: str) -> tuple[int, int]:
        weight = full_weight if weights is None else min(weights.get(peer, full_weight), full_weight)
        return weight, full_weight

    def tokens_of(taken: int) -> int:
        return schedule if taken == inner_steps else per_step * taken

    pools: dict[tuple[str, int], list[str]] = {}
    for peer, _ in contributions:
        if stages is not None and peer in stages:
            pools.setdefault(stages[peer], []).append(peer)
    count: dict[str, int] = {}  # chain -> the fewest steps one of its stages served between its workers
    for (chain, _), pool in pools.items():
        total = sum(served.get(p, inner_steps) for p in pool)
        count[chain] = min(count.get(chain, total), total)
    pooled = {peer: (chain, pool) for (chain, _), pool in pools.items() if len(pool) > 1 for peer in pool}

    rows = []
    for peer, payloads in contributions:
        taken = inner_steps if steps is None else steps.get(peer, inner_steps)
        part = (1, 1)
        if peer in pooled:
            chain, pool = pooled[peer]
            taken = inner_steps if steps is None else min(count[chain], inner_steps)
            mine = [served.get(p, 1) for p in pool]
            part = (served.get(peer, 1), sum(mine)) if sum(mine) > 0 else (1, len(pool))
        trained = tokens_of(taken)
        credited = credited_tokens(shard_tokens(trained, sizes), payloads)
        rows.append(
            Contribution(
                peer=peer,
                name=names.get(peer) or peer[-8:],
                role="anchor" if set(payloads) >= whole else "stage",
                tokens=credited * part[0] * share(peer)[0] // (part[1] * share(peer)[1]),
                inner_steps=min(served.get(peer, taken), inner_steps) if peer in pooled else taken,
                bytes_sent=sum(len(data) for data in payloads.values()),
                replica_tokens=trained,
            )
        )
    return rows


@dataclass(frozen=True)
class Verdict:
    """What the verifier made of one peer's valid contribution to one round (docs/security.md, "Send useless
    or harmful work")."""

    peer: str
    round: int
    reason: str | None  # None: verified and credited; else one of REASONS
    score: float | None  # this round's relative score (None: not scored)
    average: float | None  # the peer's exponential average after this round
    weight: int | None = None  # the weight its verified history has earned after this round

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclass(frozen=True)
class PeerScore:
    average: float | None  # the score average after its newest verdict
    last_reason: str | None  # that verdict's reason (None: credited)
    rejected: int  # contributions rejected, all rounds


@dataclass(frozen=True)
class Standing:
    """One peer's credit over all recorded rounds; `share` is its fraction of all credited tokens (0 when
    none)."""

    peer: str
    name: str
    role: str
    tokens: int  # credited
    share: float
    replica_tokens: int  # what its replicas trained in those rounds (a stage: its chain's tokens)
    rounds: int
    inner_steps: int
    bytes_sent: int
    last_round: int
    last_seen: float

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclass(frozen=True)
class LedgerTotals:
    tokens: int
    rounds: int  # distinct sealed rounds recorded
    contributions: int  # rows: (round, peer) pairs


class _Pool:
    """At most `size` connections, each lent to one caller at a time; a caller waits up to `wait_s`."""

    def __init__(self, open_: Callable[[], sqlite3.Connection], size: int, wait_s: float) -> None:
        self._open, self._wait_s = open_, wait_s
        self._slots = threading.BoundedSemaphore(size)
        self._lock = threading.Lock()
        self._idle: list[sqlite3.Connection] = []
        self.opened = self.peak = 0
        self.closed = False

    @contextlib.contextmanager
    def connection(self) -> Iterator[sqlite3.Connection]:
        if not self._slots.acquire(timeout=self._wait_s):
            raise LedgerError("ledger", f"every reader connection was busy for {self._wait_s} s")
        try:
            with self._lock:
                if self.closed:
                    raise LedgerError("ledger", "the ledger is closed")
                conn = self._idle.pop() if self._idle else None
                if conn is None:
                    self.opened += 1
                    self.peak = max(self.peak, self.opened)
            try:
                conn = conn or self._open()  # outside the lock: opening touches the disk
            except BaseException:
                with self._lock:
                    self.opened -= 1
                raise
            try:
                yield conn
            finally:
                with self._lock:
                    self._idle.append(conn)
                if self.closed:
                    self.close()
        finally:
            self._slots.release()

    def close(self) -> None:
        """Close the idle connections; one lent out is closed when it comes back."""
        with self._lock:
            self.closed = True
            idle, self._idle = self._idle, []
            self.opened -= len(idle)
        for conn in idle:
            conn.close()


class Ledger:
    """The SQLite ledger at `path` (the coordinator passes `DATA_DIR/ledger.sqlite`).

    Safe to use from any number of threads; at most `max_connections` (≥ 2) SQLite connections are open at
    once. A caller that finds every reader connection busy waits up to `busy_timeout_s`, then gets a
    `LedgerError`.
    """

    def __init__(
        self,
        path: str | Path,
        busy_timeout_s: float = BUSY_TIMEOUT_S,
        *,
        max_connections: int = MAX_CONNECTIONS,
    ) -> None:
        if max_connections < 2:
            raise LedgerError(
                "max_connections", f"must be at least 2 (a writer and a reader), got {max_connections}"
            )
        self.path = Path(path)
        self.busy_timeout_s = busy_timeout_s
        self.max_connections = max_connections
        self._write_lock = threading.Lock()
        self._writer: sqlite3.Connection | None = self._open()
        self._readers = _Pool(self._open, max_connections - 1, busy_timeout_s)
        try:
            self._create_schema()
            self._report_out_of_bounds()
        except BaseException:
            self.close()
            raise

    # -- connections ---------------------------------------------------------------------------------

    def _open(self) -> sqlite3.Connection:
        try:
            conn = sqlite3.connect(
                self.path,
                timeout=self.busy_timeout_s,
                isolation_level=None,  # transactions are explicit: BEGIN IMMEDIATE ... COMMIT
                check_same_thread=False,  # lent to one thread at a time, never shared at once
            )
            conn.execute(f"PRAGMA busy_timeout = {int(self.busy_timeout_s * 1000)}")
            conn.execute("PRAGMA journal_mode = WAL")
            conn.execute("PRAGMA synchronous = NORMAL")
        except sqlite3.Error as exc:
            raise LedgerError("path", f"cannot open the ledger at {self.path}: {exc}") from None
        return conn

    @contextlib.contextmanager
    def _writing(self) -> Iterator[sqlite3.Connection]:
        if not self._write_lock.acquire(timeout=self.busy_timeout_s):
            raise LedgerError("ledger", f"another write held the ledger for {self.busy_timeout_s} s")
        try:
            if self._writer is None:
                raise LedgerError("ledger", f"{self.path} is closed")
            yield self._writer
        finally:
            self._write_lock.release()

    def _reading(self) -> contextlib.AbstractContextManager[sqlite3.Connection]:
        return self._readers.connection()

    @property
    def peak_connections(self) -> int:
        """The most SQLite connections ever open at once (the writer's included)."""
        return self._readers.peak + 1

    def _create_schema(self) -> None:
        with self._writing() as conn:
            version = conn.execute("PRAGMA user_version").fetchone()[0]
            if version > SCHEMA_VERSION:
                raise LedgerError("schema_version", f"{self.path} has version {version}, newer than ours")
            if version == SCHEMA_VERSION:
                return
            conn.execute("BEGIN IMMEDIATE")
            try:
                for statement in _SCHEMA.split(";"):  # not executescript, which would commit first
                    if statement.strip():
                        conn.execute(statement)
                columns = {row[1] for row in conn.execute("PRAGMA table_info(contributions)")}
                if "replica_tokens" not in columns:  # a ledger of schema 1 or 2: its rows read as NULL
                    conn.execute("ALTER TABLE contributions ADD COLUMN replica_tokens INTEGER")
                columns = {row[1] for row in conn.execute("PRAGMA table_info(verdicts)")}
                if "weight" not in columns:  # schema 3 or older: no weight was earned then (NULL)
                    conn.execute("ALTER TABLE verdicts ADD COLUMN weight INTEGER")
                conn.execute(f"PRAGMA user_version = {SCHEMA_VERSION}")
                conn.execute("COMMIT")
            except BaseException:
                conn.execute("ROLLBACK")
                raise

    def _report_out_of_bounds(self) -> None:
        """Rows from before the bounds existed still load; say once that they earn nothing."""
        with self._reading() as conn:
            bad = conn.execute(_OUT_OF_BOUNDS).fetchone()[0]
        if bad:
            log.warning("ledger %s: %d rows hold counts outside [0, 2**40], credited as 0", self.path, bad)

    def release(self) -> None:
        """Nothing to do: connections are pooled, not per thread (kept for callers of the old design)."""

    def close(self) -> None:
        """Close every connection; ones lent out close when returned. Further use raises `LedgerError`."""
        self._readers.close()
        with self._write_lock:
            if self._writer is not None:
                self._writer.close()
                self._writer = None

    def __enter__(self) -> Ledger:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- writing -------------------------------------------------------------------------------------

    def record_round(self, round_: int, sealed_at: float, contributions: Sequence[Contribution]) -> int:
        """Credit the contributions of sealed round `round_`, in one transaction; returns the rows written.

        A (round, peer) already recorded is left as it was, so replaying a round counts nothing twice.
        Everything is validated first: a bad contribution raises `LedgerError` (a `ValueError`) naming the
        field and the peer, and nothing of the round is written.
        """
        rows = _validated_rows(round_, sealed_at, contributions)
        if not rows:
            return 0
        return self._insert(
            "INSERT OR IGNORE INTO contributions "
            "(round, peer, name, role, tokens, inner_steps, bytes_sent, sealed_at, replica_tokens) "
            "VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)",
            rows,
        )

    def _insert(self, statement: str, rows: Sequence[tuple]) -> int:
        """Run `statement` over `rows` in one transaction (all or nothing); the rows written."""
        with self._writing() as conn:
            conn.execute("BEGIN IMMEDIATE")  # take the write lock now, so busy_timeout applies to it
            try:
                written = conn.executemany(statement, rows).rowcount
                conn.execute("COMMIT")
            except BaseException:
                conn.execute("ROLLBACK")
                raise
        return written

    def record_verdicts(self, verdicts: Sequence[Verdict]) -> int:
        """Keep each verdict (score, average, reason), in one transaction; a (round, peer) already kept is
        left as it was. A bad verdict raises `LedgerError` and nothing is written."""
        rows = []
        for v in verdicts:
            peer = _text("peer", v.peer, MAX_PEER_CHARS, str(v.peer)[:MAX_PEER_CHARS])
            _check_int("round", v.round, MAX_INT, peer)
            if v.reason is not None and v.reason not in REASONS:
                raise LedgerError("reason", f"{v.reason!r} is not one of {REASONS}", peer)
            for field, value in (("score", v.score), ("average", v.average)):
                if value is not None and (not isinstance(value, float) or not math.isfinite(value)):
                    raise LedgerError(field, f"must be a finite float or None, got {value!r}", peer)
            if v.weight is not None:
                _check_int("weight", v.weight, MAX_COUNT, peer)
            rows.append((v.round, peer, v.reason, v.score, v.average, v.weight))
        if not rows:
            return 0
        return self._insert(
            "INSERT OR IGNORE INTO verdicts (round, peer, reason, score, average, weight)"
            " VALUES (?, ?, ?, ?, ?, ?)",
            rows,
        )

    # -- reading -------------------------------------------------------------------------------------

    def scores(self) -> dict[str, PeerScore]:
        """Every scored peer's average now, its newest reason and its rejection count."""
        with self._reading() as conn:
            rows = conn.execute(_SCORES).fetchall()
        return {peer: PeerScore(average, reason, int(rejected)) for peer, average, reason, rejected in rows}

    def verifier_state(self) -> dict[str, tuple[float | None, int, int | None, int]]:
        """{peer: (score average, scores behind it, weight earned, strikes)} after each peer's newest
        verdict (strikes: its scores below `STRIKE_SCORE`, `bootstrap/earned_weight.py`)."""
        with self._reading() as conn:
            rows = conn.execute(_STANDING, (STRIKE_SCORE,)).fetchall()
        return {
            peer: (average, int(scored), weight, int(strikes))
            for peer, average, scored, weight, strikes in rows
        }

    def rejections(self) -> dict[str, int]:
        """Rejected contributions by reason, all rounds (every reason present, zeros included)."""
        with self._reading() as conn:
            counted = dict(conn.execute(_REJECTIONS).fetchall())
        return {reason: int(counted.get(reason, 0)) for reason in REASONS}

    def recent_verdicts(self, limit: int = MAX_VERDICTS_SHOWN) -> list[Verdict]:
        """The newest verdicts first (at most `limit`)."""
        with self._reading() as conn:
            rows = conn.execute(
                "SELECT peer, round, reason, score, average, weight FROM verdicts"
                " ORDER BY round DESC, peer LIMIT ?",
                (max(0, min(limit, MAX_VERDICTS_SHOWN)),),
            ).fetchall()
        return [Verdict(*row) for row in rows]

    def standings(self) -> list[Standing]:
        """Every peer's credit, by tokens (most first), then name, then peer id."""
        with self._reading() as conn:
            rows = conn.execute(_STANDINGS).fetchall()
        # total() answers floats: the sums back to ints (exact, module docstring)
        rows = [(*r[:3], int(r[3]), int(r[4]), r[5], int(r[6]), int(r[7]), *r[8:]) for r in rows]
        total = sum(r[3] for r in rows)
        return [Standing(*r[:4], r[3] / total if total > 0 else 0.0, *r[4:]) for r in rows]

    def totals(self) -> LedgerTotals:
        with self._reading() as conn:
            tokens, rounds, contributions = conn.execute(_TOTALS).fetchone()
        return LedgerTotals(tokens=int(tokens), rounds=rounds, contributions=contributions)


def _validated_rows(
    round_: int, sealed_at: float, contributions: Sequence[Contribution]
) -> list[tuple[int, str, str, str, int, int, int, float, int]]:
    _check_int("round", round_, MAX_INT)
    if isinstance(sealed_at, bool) or not isinstance(sealed_at, int | float) or not math.isfinite(sealed_at):
        raise LedgerError("sealed_at", f"must be a finite number, got {sealed_at!r}")
    rows = []
    seen: set[str] = set()
    for c in contributions:
        if not isinstance(c, Contribution):
            raise LedgerError("contribution", f"expected a Contribution, got {type(c).__name__}")
        if not isinstance(c.peer, str) or not c.peer or len(c.peer) > MAX_PEER_CHARS:
            raise LedgerError("peer", f"must be a non-empty string of at most {MAX_PEER_CHARS} chars")
        if c.peer in seen:
            raise LedgerError("peer", f"{c.peer!r} appears twice in round {round_}", c.peer)
        seen.add(c.peer)
        for field in COUNT_FIELDS:
            _check_int(field, getattr(c, field), MAX_COUNT, c.peer, round_)
        trained = c.trained
        _check_int("replica_tokens", trained, MAX_COUNT, c.peer, round_)
        if c.tokens > trained:
            raise LedgerError(
                "tokens", f"{c.tokens} credited is more than its replica's {trained} (round {round_})", c.peer
            )
        name = _text("name", c.name, MAX_NAME_CHARS, c.peer)
        role = _text("role", c.role, MAX_ROLE_CHARS, c.peer)
        rows.append(
            (round_, c.peer, name, role, c.tokens, c.inner_steps, c.bytes_sent, float(sealed_at), trained)
        )
    return rows


def _check_int(
    field: str, value: object, limit: int, peer: str | None = None, round_: int | None = None
) -> None:
    whose = f" (peer {peer!r}, round {round_})" if peer else ""
    if isinstance(value, bool) or not isinstance(value, int):
        raise LedgerError(field, f"must be an int, got {type(value).__name__}{whose}", peer)
    if not 0 <= value <= limit:
        bound = "2**40" if limit == MAX_COUNT else "2**63 - 1"
        raise LedgerError(field, f"{value} is outside [0, {bound}]{whose}", peer)


def _text(field: str, value: object, limit: int, peer: str) -> str:
    """Peer-chosen text is kept as it is (escaping is the renderer's job), only cut to `limit` characters."""
    if not isinstance(value, str):
        raise LedgerError(field, f"must be a string, got {type(value).__name__} (peer {peer!r})", peer)
    # Lone surrogates cannot be stored as UTF-8; they become U+FFFD rather than failing the round.
    return _SURROGATE.sub("\ufffd", value[:limit])


class LedgerCollector(Collector):
    """Per-peer ledger series, read from the ledger at scrape time (register on the coordinator's registry).

    `hetnode_contribution_{tokens,rounds,inner_steps,bytes}_total{peer,name}` and the gauge
    `hetnode_contribution_share{peer,name}`; `name` is the peer's latest, so each peer has one series.
    """

    def __init__(self, ledger: Ledger) -> None:
        self.ledger = ledger

    def describe(self) -> Iterator[Metric]:
        """The families without samples, so that registering does not touch the database."""
        yield from self._families()
        yield from self._verdict_families()

    def collect(self) -> Iterator[Metric]:
        yield from self._families(self.ledger.standings())
        yield from self._verdict_families(self.ledger.rejections(), self.ledger.scores())

    @staticmethod
    def _verdict_families(
        rejections: Mapping[str, int] | None = None, scores: Mapping[str, PeerScore] | None = None
    ) -> Iterator[Metric]:
        rejected = CounterMetricFamily(
            "hetnode_contribution_rejected",
            "Valid contributions given no weight or credit, by reason (stale, copy, norm, score)",
            labels=["reason"],
        )
        for reason in REASONS:
            rejected.add_metric([reason], (rejections or {}).get(reason, 0))
        score = GaugeMetricFamily(
            "hetnode_contribution_score",
            "The peer's verification score average (below 0: no weight, no credit)",
            labels=["peer"],
        )
        for peer, entry in (scores or {}).items():
            if entry.average is not None:
                score.add_metric([peer], entry.average)
        yield from (rejected, score)

    _COUNTERS = (  # (family, Standing field, help)
        ("hetnode_contribution_tokens", "tokens", "Tokens credited in sealed rounds"),
        ("hetnode_contribution_rounds", "rounds", "Sealed rounds the peer contributed to"),
        ("hetnode_contribution_inner_steps", "inner_steps", "Inner steps credited in sealed rounds"),
        ("hetnode_contribution_bytes", "bytes_sent", "Payload bytes sent in sealed rounds"),
    )

    @classmethod
    def _families(cls, standings: Sequence[Standing] = ()) -> Iterator[Metric]:
        labels = ["peer", "name"]
        families: list[tuple[Metric, str]] = [
            (CounterMetricFamily(name, help_, labels=labels), field) for name, field, help_ in cls._COUNTERS
        ]
        share_help = "The peer's fraction of all credited tokens"
        families.append((GaugeMetricFamily("hetnode_contribution_share", share_help, labels=labels), "share"))
        for s in standings:
            for family, field in families:
                family.add_metric([s.peer, s.name], getattr(s, field))
        yield from (family for family, _ in families)
