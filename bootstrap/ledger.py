"""The contribution ledger: tokens credited per peer, one row per (sealed round, peer), in SQLite.

Credit is granted only for contributions in sealed rounds (DESIGN §3.5), so the coordinator records a round
once it is sealed and the leaderboard matches what each peer's own round log says. Rows are keyed by
(round, peer) and written with `INSERT OR IGNORE`: replaying a round after a restart never double-counts.

The coordinator's event loop writes from its worker thread while the HTTP server's threads read, so each
thread gets its own connection (sqlite3 connections must not be shared between threads) and the database
runs in WAL mode, where readers never block the writer. `LedgerCollector` turns the standings into
per-peer Prometheus series at scrape time (per-peer labels are allowed on the coordinator only, STYLE.md).
"""

from __future__ import annotations

import dataclasses
import math
import re
import sqlite3
import threading
import weakref
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from hetnode.errors import HetnodeError

SCHEMA_VERSION = 1
BUSY_TIMEOUT_S = 10.0
MAX_PEER_CHARS = 128
MAX_NAME_CHARS = 64
MAX_ROLE_CHARS = 64
MAX_INT = 2**63 - 1  # SQLite INTEGER
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
    PRIMARY KEY (round, peer)
);
CREATE INDEX IF NOT EXISTS contributions_by_peer ON contributions (peer, round);
"""

# Per-peer sums, with name and role taken from the peer's latest round (the row at MAX(round)).
_STANDINGS = """
WITH per_peer AS (
    SELECT peer, SUM(tokens) AS tokens, COUNT(*) AS rounds, SUM(inner_steps) AS inner_steps,
           SUM(bytes_sent) AS bytes_sent, MAX(round) AS last_round, MAX(sealed_at) AS last_seen
    FROM contributions GROUP BY peer
)
SELECT p.peer, c.name, c.role, p.tokens, p.rounds, p.inner_steps, p.bytes_sent, p.last_round, p.last_seen
FROM per_peer AS p JOIN contributions AS c ON c.peer = p.peer AND c.round = p.last_round
ORDER BY p.tokens DESC, c.name, p.peer
"""


class LedgerError(HetnodeError, ValueError):
    """A contribution failed validation (`field` names the part at fault), or the ledger cannot be used."""

    def __init__(self, field: str, message: str) -> None:
        self.field = field
        self.message = message
        super().__init__(f"{field}: {message}")


@dataclass(frozen=True)
class Contribution:
    """One peer's sealed contribution to one round."""

    peer: str
    name: str
    role: str
    tokens: int
    inner_steps: int
    bytes_sent: int


@dataclass(frozen=True)
class Standing:
    """One peer's credit over all recorded rounds; `share` is its fraction of all tokens (0 when none)."""

    peer: str
    name: str
    role: str
    tokens: int
    share: float
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


class _Connection(sqlite3.Connection):
    """A subclass only so that the ledger can hold weak references to its per-thread connections."""


class Ledger:
    """The SQLite ledger at `path` (the coordinator passes `DATA_DIR/ledger.sqlite`), a connection per thread.

    Threads that live only for one request (the HTTP server's) should call `release()` when done, so that
    their connection is closed at once rather than when the garbage collector finds it.
    """

    def __init__(self, path: str | Path, busy_timeout_s: float = BUSY_TIMEOUT_S) -> None:
        self.path = Path(path)
        self.busy_timeout_s = busy_timeout_s
        self._local = threading.local()
        self._connections: weakref.WeakSet[_Connection] = weakref.WeakSet()
        self._lock = threading.Lock()
        self._closed = False
        self._create_schema()

    # -- connections ---------------------------------------------------------------------------------

    def _conn(self) -> _Connection:
        if self._closed:
            raise LedgerError("ledger", f"{self.path} is closed")
        conn: _Connection | None = getattr(self._local, "conn", None)
        if conn is None:
            try:
                conn = sqlite3.connect(
                    self.path,
                    timeout=self.busy_timeout_s,
                    isolation_level=None,  # transactions are explicit: BEGIN IMMEDIATE ... COMMIT
                    check_same_thread=False,  # only so that close() may close every thread's connection
                    factory=_Connection,
                )
                conn.execute(f"PRAGMA busy_timeout = {int(self.busy_timeout_s * 1000)}")
                conn.execute("PRAGMA journal_mode = WAL")
                conn.execute("PRAGMA synchronous = NORMAL")
            except sqlite3.Error as exc:
                raise LedgerError("path", f"cannot open the ledger at {self.path}: {exc}") from None
            self._local.conn = conn
            with self._lock:
                self._connections.add(conn)
        return conn

    def _create_schema(self) -> None:
        conn = self._conn()
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
            conn.execute(f"PRAGMA user_version = {SCHEMA_VERSION}")
            conn.execute("COMMIT")
        except BaseException:
            conn.execute("ROLLBACK")
            raise

    def release(self) -> None:
        """Close the calling thread's connection, if it has one; the next call opens a new one."""
        conn = getattr(self._local, "conn", None)
        if conn is not None:
            self._local.conn = None
            with self._lock:
                self._connections.discard(conn)
            conn.close()

    def close(self) -> None:
        """Close every thread's connection. Call it once the writers and the HTTP server have stopped."""
        self._closed = True
        with self._lock:
            connections = list(self._connections)
            self._connections.clear()
        for conn in connections:
            conn.close()
        self._local = threading.local()

    def __enter__(self) -> Ledger:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- writing -------------------------------------------------------------------------------------

    def record_round(self, round_: int, sealed_at: float, contributions: Sequence[Contribution]) -> int:
        """Credit the contributions of sealed round `round_`, in one transaction; returns the rows written.

        A (round, peer) already recorded is left as it was, so replaying a round counts nothing twice.
        Everything is validated first: a bad contribution raises `LedgerError` (a `ValueError`) naming the
        field, and nothing of the round is written.
        """
        rows = _validated_rows(round_, sealed_at, contributions)
        if not rows:
            return 0
        conn = self._conn()
        conn.execute("BEGIN IMMEDIATE")  # take the write lock now, so busy_timeout applies to it
        try:
            cursor = conn.executemany(
                "INSERT OR IGNORE INTO contributions "
                "(round, peer, name, role, tokens, inner_steps, bytes_sent, sealed_at) "
                "VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
                rows,
            )
            written = cursor.rowcount
            conn.execute("COMMIT")
        except BaseException:
            conn.execute("ROLLBACK")
            raise
        return written

    # -- reading -------------------------------------------------------------------------------------

    def standings(self) -> list[Standing]:
        """Every peer's credit, by tokens (most first), then name, then peer id."""
        rows = self._conn().execute(_STANDINGS).fetchall()
        total = sum(row[3] for row in rows)
        return [
            Standing(
                peer=peer,
                name=name,
                role=role,
                tokens=tokens,
                share=tokens / total if total > 0 else 0.0,
                rounds=rounds,
                inner_steps=inner_steps,
                bytes_sent=bytes_sent,
                last_round=last_round,
                last_seen=last_seen,
            )
            for peer, name, role, tokens, rounds, inner_steps, bytes_sent, last_round, last_seen in rows
        ]

    def totals(self) -> LedgerTotals:
        tokens, rounds, contributions = (
            self._conn()
            .execute("SELECT COALESCE(SUM(tokens), 0), COUNT(DISTINCT round), COUNT(*) FROM contributions")
            .fetchone()
        )
        return LedgerTotals(tokens=tokens, rounds=rounds, contributions=contributions)


def _validated_rows(
    round_: int, sealed_at: float, contributions: Sequence[Contribution]
) -> list[tuple[int, str, str, str, int, int, int, float]]:
    _check_count("round", round_)
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
            raise LedgerError("peer", f"{c.peer!r} appears twice in round {round_}")
        seen.add(c.peer)
        for field in ("tokens", "inner_steps", "bytes_sent"):
            _check_count(field, getattr(c, field), c.peer)
        rows.append(
            (
                round_,
                c.peer,
                _text("name", c.name, MAX_NAME_CHARS, c.peer),
                _text("role", c.role, MAX_ROLE_CHARS, c.peer),
                c.tokens,
                c.inner_steps,
                c.bytes_sent,
                float(sealed_at),
            )
        )
    return rows


def _check_count(field: str, value: object, peer: str | None = None) -> None:
    whose = f" (peer {peer})" if peer else ""
    if isinstance(value, bool) or not isinstance(value, int):
        raise LedgerError(field, f"must be an int, got {type(value).__name__}{whose}")
    if not 0 <= value <= MAX_INT:
        raise LedgerError(field, f"must be in [0, 2**63), got {value}{whose}")


def _text(field: str, value: object, limit: int, peer: str) -> str:
    """Peer-chosen text is kept as it is (escaping is the renderer's job), only cut to `limit` characters."""
    if not isinstance(value, str):
        raise LedgerError(field, f"must be a string, got {type(value).__name__} (peer {peer})")
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

    def collect(self) -> Iterator[Metric]:
        try:
            standings = self.ledger.standings()
        finally:
            self.ledger.release()  # scrapes run on the HTTP server's short-lived threads
        yield from self._families(standings)

    @staticmethod
    def _families(standings: Sequence[Standing] = ()) -> Iterator[Metric]:
        labels = ["peer", "name"]
        tokens = CounterMetricFamily(
            "hetnode_contribution_tokens", "Tokens credited in sealed rounds", labels=labels
        )
        rounds = CounterMetricFamily(
            "hetnode_contribution_rounds", "Sealed rounds the peer contributed to", labels=labels
        )
        steps = CounterMetricFamily(
            "hetnode_contribution_inner_steps", "Inner steps credited in sealed rounds", labels=labels
        )
        sent = CounterMetricFamily(
            "hetnode_contribution_bytes", "Payload bytes sent in sealed rounds", labels=labels
        )
        share = GaugeMetricFamily(
            "hetnode_contribution_share", "The peer's fraction of all credited tokens", labels=labels
        )
        for s in standings:
            values = [s.peer, s.name]
            tokens.add_metric(values, s.tokens)
            rounds.add_metric(values, s.rounds)
            steps.add_metric(values, s.inner_steps)
            sent.add_metric(values, s.bytes_sent)
            share.add_metric(values, s.share)
        yield from (tokens, rounds, steps, sent, share)
