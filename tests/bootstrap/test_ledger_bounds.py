"""The ledger against hostile numbers and many threads, on real SQLite files: bounds on every count, sums
that stay exact and cannot overflow, a poisoned legacy database that still answers (also over HTTP), and a
bounded number of connections whatever the number of threads."""

from __future__ import annotations

import json
import logging
import sqlite3
import threading
import urllib.request
from pathlib import Path

import pytest

import bootstrap.ledger as ledger_module
from bootstrap.ledger import MAX_COUNT, Contribution, Ledger, LedgerError
from bootstrap.status_page import StatusBoard
from hetnode.service.http_server import HttpServer

HUGE = 2**62

# The schema as the first ledger wrote it, without the bounds: an old coordinator's database.
LEGACY_SCHEMA = """
CREATE TABLE contributions (
    round INTEGER NOT NULL, peer TEXT NOT NULL, name TEXT NOT NULL, role TEXT NOT NULL,
    tokens INTEGER NOT NULL, inner_steps INTEGER NOT NULL, bytes_sent INTEGER NOT NULL,
    sealed_at REAL NOT NULL, PRIMARY KEY (round, peer)
);
CREATE INDEX contributions_by_peer ON contributions (peer, round);
"""


def c(peer: str, tokens: int, steps: int = 10, sent: int = 100) -> Contribution:
    return Contribution(peer, f"name-{peer}", "anchor", tokens, steps, sent)


@pytest.fixture
def ledger(tmp_path: Path):
    with Ledger(tmp_path / "ledger.sqlite") as ledger:
        yield ledger


@pytest.mark.parametrize("field", ["tokens", "inner_steps", "bytes_sent"])
@pytest.mark.parametrize("value", [HUGE, MAX_COUNT + 1, 2**63, -1])
def test_a_count_out_of_bounds_is_refused_naming_field_and_peer(ledger: Ledger, field: str, value: int):
    bad = dict(tokens=1, steps=1, sent=1)
    bad[{"tokens": "tokens", "inner_steps": "steps", "bytes_sent": "sent"}[field]] = value
    with pytest.raises(LedgerError) as info:
        ledger.record_round(7, 1.0, [c("good", 5), c("mallory", **bad)])
    error = info.value
    assert (error.field, error.peer) == (field, "mallory")
    assert str(value) in str(error) and "mallory" in str(error) and "2**40" in str(error)
    assert ledger.totals().contributions == 0  # nothing of the round was written


def test_the_bound_itself_is_accepted(ledger: Ledger):
    assert ledger.record_round(0, 1.0, [c("A", MAX_COUNT, MAX_COUNT, MAX_COUNT)]) == 1
    (standing,) = ledger.standings()
    assert (standing.tokens, standing.inner_steps, standing.bytes_sent) == (MAX_COUNT,) * 3
    assert type(standing.tokens) is int and type(ledger.totals().tokens) is int


def test_sums_of_many_max_size_rows_stay_exact(ledger: Ledger):
    peers, rounds = 8, 1000  # 8000 rows of nearly 2**40: the total is just under 2**53
    expected: dict[str, int] = {}
    for r in range(rounds):
        row = [c(f"p{k}", MAX_COUNT - r - k, MAX_COUNT - r, MAX_COUNT) for k in range(peers)]
        ledger.record_round(r, float(r), row)
        for contribution in row:
            expected[contribution.peer] = expected.get(contribution.peer, 0) + contribution.tokens
    assert sum(expected.values()) > 2**52  # well past what float sums of arbitrary values get right
    standings = ledger.standings()
    assert {s.peer: s.tokens for s in standings} == expected
    assert all(s.inner_steps == sum(MAX_COUNT - r for r in range(rounds)) for s in standings)
    assert all(s.bytes_sent == rounds * MAX_COUNT for s in standings)
    assert [s.peer for s in standings] == [f"p{k}" for k in range(peers)]  # fewest subtracted first
    totals = ledger.totals()
    assert totals.tokens == sum(expected.values()) and totals.contributions == peers * rounds


def legacy_db(path: Path, rows: list[tuple]) -> None:
    conn = sqlite3.connect(path)
    try:
        conn.executescript(LEGACY_SCHEMA)
        conn.execute("PRAGMA user_version = 1")  # schema 1: before verdicts (opening migrates it)
        conn.executemany("INSERT INTO contributions VALUES (?, ?, ?, ?, ?, ?, ?, ?)", rows)
        conn.commit()
    finally:
        conn.close()


POISON = [
    (0, "mallory", "m", "anchor", HUGE, HUGE, HUGE, 1.0),
    (1, "mallory", "m", "anchor", HUGE, HUGE, HUGE, 2.0),
    (2, "mallory", "m", "anchor", HUGE, HUGE, HUGE, 3.0),  # SUM() of these overflowed: every route 500
    (2, "eve", "e", "anchor", 2**63 - 1, -5, 1.5e300, 3.0),
    (2, "trent", "t", "stage", "lots", 3, 4, 3.0),
    (2, "alice", "a", "anchor", 1000, 10, 100, 3.0),
]


def test_a_poisoned_legacy_database_still_answers(tmp_path: Path, caplog: pytest.LogCaptureFixture):
    path = tmp_path / "ledger.sqlite"
    legacy_db(path, POISON)
    with caplog.at_level(logging.WARNING, logger="bootstrap.ledger"), Ledger(path) as ledger:
        standings = {s.peer: s for s in ledger.standings()}
        assert {peer: s.tokens for peer, s in standings.items()} == {
            "alice": 1000,
            "mallory": 0,  # a value outside the bounds was never valid credit
            "eve": 0,
            "trent": 0,
        }
        assert (standings["mallory"].rounds, standings["trent"].inner_steps) == (3, 3)
        assert standings["alice"].share == 1.0
        totals = ledger.totals()
        assert (totals.tokens, totals.rounds, totals.contributions) == (1000, 3, 6)
        ledger.record_round(3, 4.0, [c("alice", 24)])  # and it keeps recording
        assert ledger.totals().tokens == 1024
    assert "5 rows hold counts outside [0, 2**40]" in caplog.text


def test_the_status_api_answers_over_a_poisoned_legacy_database(tmp_path: Path):
    path = tmp_path / "ledger.sqlite"
    legacy_db(path, POISON)
    with Ledger(path) as ledger:
        http = HttpServer("127.0.0.1", 0, StatusBoard(ledger).routes())
        http.start()
        try:
            for route in ("/api/contributions", "/api/status", "/"):
                with urllib.request.urlopen(f"{http.url}{route}", timeout=10) as response:
                    assert response.status == 200
                    body = response.read()
            with urllib.request.urlopen(f"{http.url}/api/contributions", timeout=10) as response:
                assert json.loads(response.read())["total_tokens"] == 1000
            assert body
        finally:
            http.stop()


class CountingConnection(sqlite3.Connection):
    """Counts the SQLite connections alive in the process, independently of the ledger's own counters."""

    lock = threading.Lock()
    alive = 0
    most = 0

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        with CountingConnection.lock:
            CountingConnection.alive += 1
            CountingConnection.most = max(CountingConnection.most, CountingConnection.alive)
        self._open = True

    def close(self) -> None:
        if self._open:
            self._open = False
            with CountingConnection.lock:
                CountingConnection.alive -= 1
        super().close()


def test_fifty_reader_threads_never_hold_more_than_the_cap(tmp_path: Path, monkeypatch):
    real_connect = sqlite3.connect
    monkeypatch.setattr(
        ledger_module.sqlite3, "connect", lambda *a, **k: real_connect(*a, **k, factory=CountingConnection)
    )
    cap = 4
    ledger = Ledger(tmp_path / "ledger.sqlite", max_connections=cap)
    for r in range(200):
        ledger.record_round(r, float(r), [c(f"p{k}", r + k) for k in range(10)])
    expected = {f"p{k}": sum(r + k for r in range(200)) for k in range(10)}
    threads, errors = 50, []
    start = threading.Barrier(threads)

    def reader() -> None:
        try:
            start.wait()
            for _ in range(10):
                assert {s.peer: s.tokens for s in ledger.standings()} == expected
                assert ledger.totals().contributions == 2000
        except BaseException as exc:  # noqa: BLE001 (reported by the assert below)
            errors.append(exc)

    workers = [threading.Thread(target=reader) for _ in range(threads)]
    for w in workers:
        w.start()
    for w in workers:
        w.join(timeout=60)
    assert not any(w.is_alive() for w in workers) and errors == []
    assert 2 <= CountingConnection.most <= cap  # contended, yet never more than the cap
    assert ledger.peak_connections <= cap
    ledger.close()
    assert CountingConnection.alive == 0


def test_a_reader_waits_for_a_free_connection_then_gives_up(tmp_path: Path):
    with Ledger(tmp_path / "ledger.sqlite", busy_timeout_s=0.2, max_connections=2) as ledger:
        ledger.record_round(0, 1.0, [c("A", 1)])
        with ledger._readers.connection():  # the only reader connection, held
            with pytest.raises(LedgerError, match="busy"):
                ledger.standings()
            # the writer has its own connection: sealing never waits behind status-page readers
            assert ledger.record_round(1, 2.0, [c("A", 2)]) == 1
        assert ledger.totals().tokens == 3


def test_at_least_two_connections(tmp_path: Path):
    with pytest.raises(LedgerError, match="max_connections"):
        Ledger(tmp_path / "ledger.sqlite", max_connections=1)
