"""The contribution ledger: credit per peer, idempotent replays, restarts, concurrent writers, validation,
and the per-peer Prometheus series."""

import math
import sqlite3
import threading
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from bootstrap.ledger import SCHEMA_VERSION, Contribution, Ledger, LedgerCollector, LedgerError


def c(
    peer: str, tokens: int, name: str | None = None, role: str = "anchor", steps: int = 10, sent: int = 100
):
    return Contribution(peer, name or f"name-{peer}", role, tokens, steps, sent)


# round -> contributions; credit per peer is the sum of its tokens over the rounds it appears in
ROUNDS = {
    0: [c("A", 1000), c("B", 500, role="stage"), c("C", 0)],
    1: [c("A", 1200), c("B", 700, role="stage")],
    2: [c("B", 900, name="bee", role="anchor"), c("D", 4000, steps=3, sent=7)],
}
EXPECTED_TOKENS = {"A": 2200, "B": 2100, "C": 0, "D": 4000}


@pytest.fixture
def ledger(tmp_path: Path):
    with Ledger(tmp_path / "ledger.sqlite") as ledger:
        yield ledger


def fill(ledger: Ledger) -> None:
    for round_, contributions in ROUNDS.items():
        assert ledger.record_round(round_, 1000.0 + round_, contributions) == len(contributions)


def test_credit_is_the_tokens_recorded_per_peer(ledger: Ledger):
    fill(ledger)
    standings = {s.peer: s for s in ledger.standings()}
    assert {peer: s.tokens for peer, s in standings.items()} == EXPECTED_TOKENS
    b = standings["B"]
    assert (b.rounds, b.inner_steps, b.bytes_sent, b.last_round, b.last_seen) == (3, 30, 300, 2, 1002.0)
    assert (b.name, b.role) == ("bee", "anchor")  # from its latest round
    assert (standings["D"].inner_steps, standings["D"].bytes_sent) == (3, 7)
    totals = ledger.totals()
    assert (totals.tokens, totals.rounds, totals.contributions) == (8300, 3, 7)


def test_standings_order_and_shares(ledger: Ledger):
    fill(ledger)
    # E and Z tie B on tokens: "aardvark" sorts before "bee", and peer id breaks the tie between E and Z
    ledger.record_round(3, 1003.0, [c("Z", 2100, name="aardvark"), c("E", 2100, name="aardvark")])
    standings = ledger.standings()
    assert [s.peer for s in standings] == ["D", "A", "E", "Z", "B", "C"]
    total = 8300 + 2 * 2100
    shares = [4000, 2200, 2100, 2100, 2100, 0]
    assert [s.share for s in standings] == pytest.approx([t / total for t in shares])
    assert math.isclose(sum(s.share for s in standings), 1.0)


def test_shares_are_zero_when_no_tokens(ledger: Ledger):
    ledger.record_round(0, 1.0, [c("A", 0), c("B", 0)])
    assert [s.share for s in ledger.standings()] == [0.0, 0.0]
    assert ledger.standings()[0].as_dict()["tokens"] == 0


def test_empty_ledger(ledger: Ledger):
    assert ledger.standings() == []
    assert (ledger.totals().tokens, ledger.totals().rounds, ledger.totals().contributions) == (0, 0, 0)
    assert ledger.record_round(5, 1.0, []) == 0


def test_replayed_round_is_not_counted_twice(ledger: Ledger):
    fill(ledger)
    assert ledger.record_round(1, 2000.0, ROUNDS[1]) == 0
    # a replay with one new peer writes only that peer's row; the others keep their first values
    assert ledger.record_round(1, 2000.0, [c("A", 999_999), c("F", 5)]) == 1
    standings = {s.peer: s.tokens for s in ledger.standings()}
    assert standings == EXPECTED_TOKENS | {"F": 5}
    assert ledger.totals().contributions == 8


def test_restart_keeps_totals_and_standings(tmp_path: Path):
    path = tmp_path / "ledger.sqlite"
    with Ledger(path) as first:
        fill(first)
        before = (first.standings(), first.totals())
    with Ledger(path) as second:
        assert (second.standings(), second.totals()) == before
        assert second.record_round(0, 1000.0, ROUNDS[0]) == 0  # the restarted coordinator replays round 0
        assert second.totals() == before[1]
    conn = sqlite3.connect(path)
    try:
        assert conn.execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION
        assert conn.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    finally:
        conn.close()


def test_a_newer_schema_is_refused(tmp_path: Path):
    path = tmp_path / "ledger.sqlite"
    conn = sqlite3.connect(path)
    conn.execute(f"PRAGMA user_version = {SCHEMA_VERSION + 1}")
    conn.close()
    with pytest.raises(LedgerError, match="schema_version"):
        Ledger(path)


def test_concurrent_writers_lose_no_rows(ledger: Ledger):
    threads, rounds_each, peers = 8, 25, 3
    errors: list[BaseException] = []
    start = threading.Barrier(threads + 1)

    def writer(t: int) -> None:
        try:
            start.wait()
            for i in range(rounds_each):
                round_ = t * rounds_each + i
                ledger.record_round(round_, float(round_), [c(f"p{k}", round_ + k) for k in range(peers)])
                ledger.standings()  # readers interleave with the writers
        except BaseException as exc:  # noqa: BLE001 (reported by the assert below)
            errors.append(exc)
        finally:
            ledger.release()

    workers = [threading.Thread(target=writer, args=(t,)) for t in range(threads)]
    for w in workers:
        w.start()
    start.wait()
    for w in workers:
        w.join(timeout=60)
    assert not any(w.is_alive() for w in workers)
    assert errors == []
    n = threads * rounds_each
    totals = ledger.totals()
    assert (totals.rounds, totals.contributions) == (n, n * peers)
    expected = {f"p{k}": sum(r + k for r in range(n)) for k in range(peers)}
    assert {s.peer: s.tokens for s in ledger.standings()} == expected


GOOD = c("A", 10)


@pytest.mark.parametrize(
    ("round_", "sealed_at", "bad", "field"),
    [
        (0, 1.0, c("B", -1), "tokens"),
        (0, 1.0, c("B", True), "tokens"),
        (0, 1.0, c("B", 1.5), "tokens"),
        (0, 1.0, c("B", 2**63), "tokens"),
        (0, 1.0, c("B", 1, steps=-3), "inner_steps"),
        (0, 1.0, c("B", 1, sent=False), "bytes_sent"),
        (0, 1.0, c("", 1), "peer"),
        (0, 1.0, c("x" * 129, 1), "peer"),
        (0, 1.0, c("A", 1), "peer"),  # twice in one round
        (0, 1.0, Contribution("B", None, "anchor", 1, 1, 1), "name"),
        (0, float("nan"), c("B", 1), "sealed_at"),
        (0, float("inf"), c("B", 1), "sealed_at"),
        (-1, 1.0, c("B", 1), "round"),
        (True, 1.0, c("B", 1), "round"),
    ],
)
def test_bad_input_raises_and_writes_nothing(ledger: Ledger, round_, sealed_at, bad, field):
    with pytest.raises(ValueError, match=field) as info:
        ledger.record_round(round_, sealed_at, [GOOD, bad])
    assert isinstance(info.value, LedgerError) and info.value.field == field
    assert ledger.totals().contributions == 0


def test_peer_chosen_text_is_kept_and_names_truncated(ledger: Ledger):
    name = "<script>alert(1)</script>" + "é" * 100
    ledger.record_round(0, 1.0, [c("A", 1, name=name, role="<b>stage</b>"), c("B", 1, name="\ud800x")])
    standings = {s.peer: s for s in ledger.standings()}
    assert standings["A"].name == name[:64]
    assert standings["A"].role == "<b>stage</b>"
    assert standings["B"].name == "\ufffdx"


def test_closed_ledger_refuses_use(tmp_path: Path):
    ledger = Ledger(tmp_path / "ledger.sqlite")
    ledger.close()
    with pytest.raises(LedgerError, match="closed"):
        ledger.standings()


def test_collector_exposition(ledger: Ledger):
    registry = CollectorRegistry()
    registry.register(LedgerCollector(ledger))
    empty = generate_latest(registry).decode()
    assert "# TYPE hetnode_contribution_tokens_total counter" in empty
    assert "hetnode_contribution_tokens_total{" not in empty

    fill(ledger)
    ledger.record_round(3, 1003.0, [c("Q", 7, name='quote"d\nname')])
    text = generate_latest(registry).decode()
    names = {"A": "name-A", "B": "bee", "C": "name-C", "D": "name-D"}  # B's latest name
    for peer, tokens in EXPECTED_TOKENS.items():
        assert f'hetnode_contribution_tokens_total{{name="{names[peer]}",peer="{peer}"}} {tokens}.0' in text
    assert 'name="name-B"' not in text  # one series per peer
    assert 'hetnode_contribution_tokens_total{name="quote\\"d\\nname",peer="Q"} 7.0' in text
    assert 'hetnode_contribution_rounds_total{name="bee",peer="B"} 3.0' in text
    assert 'hetnode_contribution_inner_steps_total{name="name-D",peer="D"} 3.0' in text
    assert 'hetnode_contribution_bytes_total{name="name-D",peer="D"} 7.0' in text
    assert f'hetnode_contribution_share{{name="name-D",peer="D"}} {4000 / 8307!r}' in text
    assert "# TYPE hetnode_contribution_share gauge" in text


def test_verdicts_keep_scores_and_reasons(tmp_path):
    """What the verifier decided is kept per (round, peer): scores, averages, and why work was refused."""
    from bootstrap.ledger import REASONS, Verdict

    with Ledger(tmp_path / "ledger.sqlite") as ledger:
        assert ledger.rejections() == dict.fromkeys(REASONS, 0) and ledger.scores() == {}
        ledger.record_verdicts(
            [
                Verdict("p-honest", 0, None, 0.8, 0.8),
                Verdict("p-noise", 0, None, -1.3, -1.3),
                Verdict("p-copy", 0, "copy", None, None),
            ]
        )
        ledger.record_verdicts(
            [Verdict("p-noise", 1, "score", -0.9, -1.1), Verdict("p-honest", 1, None, 0.6, 0.7)]
        )
        assert ledger.record_verdicts([Verdict("p-noise", 1, "score", 5.0, 5.0)]) == 0  # kept as it was
        assert ledger.rejections() == {"stale": 0, "copy": 1, "norm": 0, "score": 1, "probation": 0}
        scores = ledger.scores()
        assert scores["p-honest"].average == 0.7 and scores["p-honest"].rejected == 0
        assert scores["p-noise"].average == -1.1 and scores["p-noise"].last_reason == "score"
        assert [v.round for v in ledger.recent_verdicts()] == [1, 1, 0, 0, 0]
        for bad in (
            Verdict("p", 2, "greed", None, None),
            Verdict("p", 2, None, float("nan"), None),
            Verdict("p", 2, None, 0.5, 0.5, weight=-1),
        ):
            with pytest.raises(LedgerError):
                ledger.record_verdicts([bad])
        # what a restarted verifier takes up: each peer's newest average, its scores and the weight earned
        ledger.record_verdicts([Verdict("p-honest", 2, None, 0.9, 0.8, weight=3)])
        state = ledger.verifier_state()
        assert state["p-honest"] == (0.8, 3, 3, 0) and state["p-noise"][:3] == (-1.1, 2, None)
        assert state["p-noise"][3] >= 1  # a score below STRIKE_SCORE is kept as a strike
        assert state["p-copy"] == (None, 0, None, 0)


def test_a_schema_3_ledger_gains_the_weight_column(tmp_path):
    import sqlite3

    from bootstrap.ledger import Verdict

    path = tmp_path / "ledger.sqlite"
    conn = sqlite3.connect(path)
    conn.execute(
        "CREATE TABLE verdicts (round INTEGER NOT NULL, peer TEXT NOT NULL, reason TEXT, score REAL,"
        " average REAL, PRIMARY KEY (round, peer))"
    )
    conn.execute("INSERT INTO verdicts VALUES (0, 'old', NULL, 0.5, 0.5)")
    conn.execute("PRAGMA user_version = 3")
    conn.commit()
    conn.close()
    with Ledger(path) as ledger:
        assert ledger.verifier_state() == {"old": (0.5, 1, None, 0)}
        ledger.record_verdicts([Verdict("old", 1, None, 0.7, 0.6, weight=2)])
        assert ledger.verifier_state()["old"] == (0.6, 2, 2, 0)
