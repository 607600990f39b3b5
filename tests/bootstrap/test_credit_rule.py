"""The one chain-credit rule (docs/observability.md, "Contribution credit"): a sealed contribution earns its
replica's schedule; a chain's stages split it in proportion to the parameters of the shards each delivered,
adding up to exactly the chain's tokens; the ledger keeps both numbers per row, and the status page shows
both, under headers that say which is which."""

from __future__ import annotations

import sqlite3
from pathlib import Path
from types import SimpleNamespace

import pytest

from bootstrap.ledger import Contribution, Ledger, LedgerError, credit_round, shard_tokens
from bootstrap.round_keeper import RoundKeeper
from bootstrap.status_html import render_page
from hetnode.config import load_config, replace
from hetnode.planning.rounds import replica_tokens, shard_order
from hetnode.replica.global_model import GlobalModel

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def tiny():
    """The demo's model: tiny at H = 10 (20,480 tokens a replica a round), its shards and their sizes."""
    config = replace(load_config(ROOT / "configs" / "tiny.toml"), "outer", inner_steps=10)
    model = GlobalModel(config)
    order = shard_order(config.model.n_layers)
    return replica_tokens(config), [(shard, model.dense_bytes([shard]) // 4) for shard in order]


def payloads(shards):
    return {shard: b"x" * 10 for shard in shards}


@pytest.mark.parametrize(
    "split",
    [
        (["embed", "0", "1", "2"], ["3", "head"]),  # the demo's chain: 3 blocks | 1 block
        (["embed", "0", "1"], ["2", "3", "head"]),
        (["embed", "0"], ["1"], ["2", "3", "head"]),  # a chain of 3
    ],
)
def test_a_chains_stages_split_its_tokens_by_parameters_and_add_up_to_them(tiny, split):
    schedule, sizes = tiny
    params = dict(sizes)
    total = sum(params.values())
    sealed = [("anchor", payloads(params))] + [(f"stage-{i}", payloads(s)) for i, s in enumerate(split)]
    rows = {r.peer: r for r in credit_round(schedule, sizes, 10, sealed, {"anchor": "anchor-1"})}

    anchor = rows.pop("anchor")
    assert (anchor.name, anchor.role, anchor.tokens, anchor.replica_tokens) == (
        "anchor-1",
        "anchor",
        schedule,
        schedule,
    )
    assert sum(r.tokens for r in rows.values()) == schedule  # the chain's tokens, split, not copied
    for i, shards in enumerate(split):
        row = rows[f"stage-{i}"]
        share = sum(params[s] for s in shards) / total
        assert row.role == "stage" and row.replica_tokens == schedule  # each stage trained all of them
        assert abs(row.tokens - schedule * share) < 1  # in proportion to its parameters
        assert (row.inner_steps, row.bytes_sent) == (10, 10 * len(shards))


def test_the_demos_chain_gets_what_the_docs_say(tiny):
    """docs/observability.md's example: 3 blocks | 1 block of tiny earn 14,884 and 5,596 of 20,480."""
    schedule, sizes = tiny
    assert schedule == 20480 and sum(n for _, n in sizes) == 885_888
    sealed = [("a", payloads(["embed", "0", "1", "2"])), ("b", payloads(["3", "head"]))]
    assert [r.tokens for r in credit_round(schedule, sizes, 10, sealed, {})] == [14884, 5596]


def test_no_set_of_shards_earns_more_than_one_replica(tiny):
    schedule, sizes = tiny
    per_shard = shard_tokens(schedule, sizes)
    assert sum(per_shard.values()) == schedule and all(v >= 0 for v in per_shard.values())
    # a stage claiming extra or unknown shards earns at most the schedule; names earn nothing
    greedy = [("g", payloads([*dict(sizes), "bogus"]))]
    assert credit_round(schedule, sizes, 10, greedy, {"g": "x" * 1000})[0].tokens == schedule
    assert shard_tokens(7, [("a", 1), ("b", 1), ("c", 1)]) == {"a": 2, "b": 2, "c": 3}  # 7 in all
    with pytest.raises(LedgerError):
        shard_tokens(10, [("a", 0)])


def test_the_ledger_keeps_credited_and_replica_tokens_and_refuses_more_credit_than_trained(tmp_path, tiny):
    schedule, sizes = tiny
    sealed = [
        ("A", payloads(dict(sizes))),
        ("S0", payloads(["embed", "0", "1", "2"])),
        ("S1", payloads(["3", "head"])),
    ]
    with Ledger(tmp_path / "ledger.sqlite") as ledger:
        for round_ in range(3):
            ledger.record_round(round_, 1.0 + round_, credit_round(schedule, sizes, 10, sealed, {}))
        standings = {s.peer: s for s in ledger.standings()}
        assert {p: (s.tokens, s.replica_tokens) for p, s in standings.items()} == {
            "A": (3 * schedule, 3 * schedule),
            "S0": (3 * 14884, 3 * schedule),
            "S1": (3 * 5596, 3 * schedule),
        }
        assert standings["S0"].share == pytest.approx(14884 / (2 * schedule))
        assert standings["S0"].as_dict()["replica_tokens"] == 3 * schedule  # what /api/* serve
        too_much = Contribution("X", "x", "stage", 200, 1, 1, replica_tokens=100)
        with pytest.raises(LedgerError, match="tokens"):
            ledger.record_round(9, 1.0, [too_much])

        page = render_page({}, ledger.standings(), 10.0)
    # the leaderboard says which column is which, and shows both
    assert "<th>replica tokens</th><th>credited tokens</th><th>share</th>" in page
    assert '<td class="n">61,440</td><td class="n">44,652</td><td class="n">36.3 %</td>' in page
    assert "Contribution credit" in page


def test_a_ledger_of_schema_2_gains_the_column_and_its_rows_read_as_their_own_tokens(tmp_path):
    path = tmp_path / "ledger.sqlite"
    conn = sqlite3.connect(path)
    conn.executescript(
        "CREATE TABLE contributions (round INTEGER NOT NULL, peer TEXT NOT NULL, name TEXT NOT NULL,"
        " role TEXT NOT NULL, tokens INTEGER NOT NULL, inner_steps INTEGER NOT NULL,"
        " bytes_sent INTEGER NOT NULL, sealed_at REAL NOT NULL, PRIMARY KEY (round, peer));"
        "INSERT INTO contributions VALUES (0, 'old', 'o', 'stage', 500, 1, 1, 1.0);"
        "PRAGMA user_version = 2;"
    )
    conn.close()
    with Ledger(path) as ledger:
        ledger.record_round(1, 2.0, [Contribution("old", "o", "stage", 300, 1, 1, replica_tokens=1000)])
        (old,) = ledger.standings()
        assert (old.tokens, old.replica_tokens, old.rounds) == (800, 1500, 2)


def test_paced_rounds_credit_each_replica_its_own_steps_and_a_chain_its_h(tiny):
    schedule, sizes = tiny  # H = 10
    per_step = schedule // 10
    chain = (["embed", "0", "1", "2"], ["3", "head"])
    sealed = [("fast", payloads(dict(sizes))), ("slow", payloads(dict(sizes)))]
    sealed += [(f"stage-{i}", payloads(s)) for i, s in enumerate(chain)]
    steps = {"fast": 20, "slow": 3, "stage-0": 10, "stage-1": 10}
    rows = {r.peer: r for r in credit_round(schedule, sizes, 10, sealed, {}, steps=steps)}
    assert (rows["fast"].tokens, rows["fast"].inner_steps) == (20 * per_step, 20)
    assert (rows["slow"].tokens, rows["slow"].replica_tokens) == (3 * per_step, 3 * per_step)
    assert rows["stage-0"].tokens + rows["stage-1"].tokens == schedule  # a chain: its H, as before
    # weight still scales credit: a newcomer at half weight earns half its steps' tokens
    half = credit_round(schedule, sizes, 10, sealed[:1], {}, {"fast": 1}, 2, steps)[0]
    assert half.tokens == 10 * per_step


def test_a_stage_pool_splits_its_stages_share_by_the_steps_each_served(tiny):
    """A stage held by two workers (each trains its own copy of the slice on the micro-batches routed to
    it) earns what a lone stage would, split by their steps: the chain earns one replica's schedule."""
    schedule, sizes = tiny  # H = 10
    split = (["embed", "0", "1", "2"], ["3", "head"])
    sealed = [("a", payloads(split[0])), ("b", payloads(split[0])), ("s", payloads(split[1]))]
    stages = {"a": ("c1-0", 0), "b": ("c1-0", 0), "s": ("c1-0", 1)}
    served = {"a": 4, "b": 6, "s": 10}
    lone = {r.peer: r for r in credit_round(schedule, sizes, 10, [sealed[0], sealed[2]], {})}
    rows = {r.peer: r for r in credit_round(schedule, sizes, 10, sealed, {}, stages=stages, served=served)}
    assert rows["a"].tokens == lone["a"].tokens * 4 // 10 and rows["b"].tokens == lone["a"].tokens * 6 // 10
    assert rows["s"].tokens == lone["s"].tokens
    assert sum(r.tokens for r in rows.values()) <= schedule  # the pool is one stage, not two
    assert (rows["a"].inner_steps, rows["b"].inner_steps, rows["a"].replica_tokens) == (4, 6, schedule)
    # without the stages each worker was credited a lone stage's share: the chain earned more than H
    unsplit = credit_round(schedule, sizes, 10, sealed, {})
    assert sum(r.tokens for r in unsplit) > schedule
    # paced: the stage's steps are the chain's count (its fewest stage, the pool's served summed), split
    per_step = schedule // 10
    paced = {"a": 3, "b": 4, "s": 7}
    rows = {
        r.peer: r
        for r in credit_round(schedule, sizes, 10, sealed, {}, steps=paced, stages=stages, served=paced)
    }
    stage_0 = lone["a"].tokens * 7 * per_step // schedule
    assert abs(rows["a"].tokens - stage_0 * 3 / 7) <= 1 and abs(rows["b"].tokens - stage_0 * 4 / 7) <= 1
    assert rows["a"].replica_tokens == rows["s"].replica_tokens == 7 * per_step
    assert sum(r.tokens for r in rows.values()) <= 7 * per_step


def test_the_coordinator_credits_a_pool_by_the_steps_its_sealed_workers_served(tiny):
    """`RoundKeeper.credits` hands the ledger each chain member's stage and the seal's steps."""
    schedule, sizes = tiny
    config = replace(load_config(ROOT / "configs" / "tiny.toml"), "outer", inner_steps=10)
    keeper = SimpleNamespace(config=config, global_model=GlobalModel(config))
    split = (["embed", "0", "1", "2"], ["3", "head"])
    contributions = [("a", payloads(split[0])), ("b", payloads(split[0])), ("s", payloads(split[1]))]
    sealed = SimpleNamespace(
        contributions=contributions, earned={}, record={"contributions": []}, steps={"a": 4, "b": 6, "s": 10}
    )
    stages = {"a": ("c1-0", 0), "b": ("c1-0", 0), "s": ("c1-0", 1)}
    rows = {r.peer: r.tokens for r in RoundKeeper.credits(keeper, sealed, {}, stages)}
    lone = {r.peer: r.tokens for r in credit_round(schedule, sizes, 10, [contributions[0]], {})}
    assert rows["a"] == lone["a"] * 4 // 10 and rows["b"] == lone["a"] * 6 // 10
