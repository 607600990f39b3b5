"""The demo's report, live view and digest check, on hand-made data: tables, ratios, the story told, plots
for 0, 1 and many rounds, and what counts as digest agreement."""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest
from rich.console import Console

from hetnode.lab.demo.credit import credit_standings
from hetnode.lab.demo.digests import compare_digests, hold_round
from hetnode.lab.demo.live import LiveView, plain_line, render
from hetnode.lab.demo.markdown import CONTRIBUTION_HEADERS, cell, render_markdown, result_line, table
from hetnode.lab.demo.report import DemoRecord, summarise, write_report
from hetnode.lab.demo.rounds import eta_s, human_bytes, round_bytes, seconds_per_round, swarm_counts

PROCESSES = [
    {
        "name": "coordinator",
        "role": "coordinator",
        "bandwidth_mbit": None,
        "peer_id": "Qcoord",
        "log": "/x/c.log",
    },
    {"name": "anchor-1", "role": "anchor", "bandwidth_mbit": 1000.0, "peer_id": "Qa1", "log": "/x/a1.log"},
    {"name": "edge_1", "role": "stage", "bandwidth_mbit": 20.0, "peer_id": "Qe1", "log": "/x/e1.log"},
    {"name": "edge|2", "role": "stage", "bandwidth_mbit": 20.0, "peer_id": "Qe2", "log": "/x/e2.log"},
]
DIGESTS = {"embed": "aa", "0": "bb", "head": "cc"}
# the ledger's rows as the coordinator writes them into a seal line (`credits`): a replica's 20,480 tokens,
# a chain's split over its two stages by parameters (the tiny model split embed, 0-2 | 3, head)
CREDITS = {
    "Qa1": {"name": "anchor-1", "role": "anchor", "tokens": 20480, "replica_tokens": 20480, "bytes": 50_000},
    "Qe1": {"name": "edge_1", "role": "stage", "tokens": 14884, "replica_tokens": 20480, "bytes": 20_000},
    "Qe2": {"name": "edge|2", "role": "stage", "tokens": 5596, "replica_tokens": 20480, "bytes": 5_000},
}


def entry(round_: int, loss: float, with_chain: bool = True) -> dict:
    contributors = ["Qa1", "Qe1", "Qe2"] if with_chain else ["Qa1"]
    return {
        "credits": {peer: CREDITS[peer] for peer in contributors},
        "rejected": {},
        "round": round_,
        "contributors": contributors,
        "excluded": [],
        "tokens": 40960 if with_chain else 20480,
        "eval_loss": loss,
        "time": 1000.0 + 10 * round_,
        "layer_digests": {k: f"{v}{round_}" for k, v in DIGESTS.items()},
        "payload_bytes": {"anchor": 50_000, "stage": 25_000 if with_chain else 0},
        "dense_bytes": 7_500_000 if with_chain else 5_000_000,
    }


def record(tmp_path: Path, rounds: int, **extra) -> DemoRecord:
    history = [entry(r, 5.5 - 0.5 * r, with_chain=r > 0) for r in range(rounds)]
    fields = {
        "out": tmp_path,
        "config_path": tmp_path / "config.toml",
        "config": {
            "run": {"name": "tiny"},
            "model": {"d_model": 128, "n_layers": 4},
            "outer": {"inner_steps": 10},
            "pipeline": {"stages": 2, "compression": "selective"},
        },
        "requested_rounds": 3,
        "outcome": "finished",
        "wall_s": 95.0,
        "status_url": "http://127.0.0.1:1234",
        "processes": PROCESSES,
        "history": history,
        "chains": [{"chain": "c3-abc", "members": ["edge_1", "edge|2"], "live": True, "first_seen": 0}],
        "contributions": {
            "standings": [
                {
                    "name": "anchor-1",
                    "peer": "Qa1",
                    "role": "anchor",
                    "tokens": 60000,
                    "share": 0.6,
                    "rounds": 3,
                },
                {
                    "name": "edge_1",
                    "peer": "Qe1",
                    "role": "stage",
                    "tokens": 40000,
                    "share": 0.4,
                    "rounds": 2,
                },
            ]
        },
        "digests": {
            "agree": True,
            "rounds": [rounds - 1],
            "peers": [{"name": "anchor-1", "params_round": rounds - 1, "agree": True, "reason": None}],
        },
        "round_logs": {
            "anchor-1": [{"round": 0, "tokens": 20480, "upload_bytes": 50000, "included": True}],
            "edge_1": [  # trained 6 s of every 10 s round
                {
                    "round": r,
                    "role": "stage",
                    "train_s": 6.0,
                    "tokens": 2048,
                    "upload_bytes": 1000,
                    "time": 100.0 + 10 * r + 6,
                    "started_at": 100.0 + 10 * r,
                    "tokens_per_s": 341.3,
                }
                for r in range(3)
            ],
        },
    }
    return DemoRecord(**(fields | extra))


def test_round_bytes_and_the_ratio_against_dense_fp32():
    b = round_bytes(entry(1, 4.0))
    assert (b.anchor, b.stage, b.sparse, b.dense) == (50_000, 25_000, 75_000, 7_500_000)
    assert b.ratio == pytest.approx(100.0)
    assert round_bytes({"payload_bytes": {}, "dense_bytes": 0}).ratio is None  # nothing sent: no ratio
    assert round_bytes({"payload_bytes": None, "dense_bytes": "x"}).sparse == 0  # hostile shapes: zeros


def test_pace_and_eta_come_from_the_seal_times():
    history = [entry(r, 5.0) for r in range(3)]
    assert seconds_per_round(history) == pytest.approx(10.0)
    assert eta_s(history, 8) == pytest.approx(50.0)
    assert eta_s(history[:1], 8) is None and eta_s(history, 3) == 0.0
    assert human_bytes(999) == "999 B" and human_bytes(56_300) == "56.3 KB"


def test_summary_counts_rounds_losses_bytes_and_names(tmp_path):
    summary = summarise(record(tmp_path, 3))
    assert summary["sealed_rounds"] == 3 and summary["eval_loss"] == [5.5, 5.0, 4.5]
    assert (summary["loss_start"], summary["loss_end"]) == (5.5, 4.5)
    assert summary["first_stage_round"] == 1
    assert summary["rounds"][1]["contributor_names"] == ["anchor-1", "edge_1", "edge|2"]
    assert summary["rounds"][1]["ratio"] == pytest.approx(100.0)
    assert summary["rounds"][0]["ratio"] == pytest.approx(100.0)  # 5 MB / 50 KB
    total = summary["bytes"]["total"]
    assert total == {"anchor": 150_000, "stage": 50_000, "sparse": 200_000, "dense": 20_000_000}
    assert summary["bytes"]["ratio"] == pytest.approx(100.0)
    assert summary["bytes"]["mean_per_round"]["sparse"] == pytest.approx(200_000 / 3)
    assert summary["digests_agree"] is True
    assert [c["name"] for c in summary["contributions"]] == ["anchor-1", "edge_1", "edge|2"]
    assert summary["swarm"] == {"peers": 3, "anchors": 1, "edges": 2, "chains": 1, "replicas": 2}
    assert summary["processes"][1]["log"] == "/x/a1.log"  # outside OUT: kept absolute
    traffic = {t["name"]: t for t in summary["peer_traffic"]}
    assert traffic["edge_1"]["compute_utilization"] == pytest.approx(round(18 / 26, 3))
    assert traffic["anchor-1"]["compute_utilization"] is None  # a log line without its times
    json.dumps(summary)  # summary.json must serialise


def test_markdown_has_the_round_table_and_escapes_only_what_breaks_a_table(tmp_path):
    text = render_markdown(summarise(record(tmp_path, 3)))
    assert "| round | contributors | tokens | eval loss | anchors | stages | dense fp32 | smaller |" in text
    assert (
        "| 1 | 3 (anchor-1, edge_1, edge\\|2) | 40,960 | 5.000 | 50.0 KB | 25.0 KB | 7.5 MB | 100× |" in text
    )
    assert "edge_1" in text and "edge\\_1" not in text and "anchor\\-1" not in text  # no markdown escaping
    assert "&lt;" not in text and "&amp;" not in text  # nor HTML escaping
    assert "Eval loss fell from 5.500 (round 0) to 4.500 (round 2)" in text
    assert "first contributed in round 1" in text
    assert "100× less" in text
    assert "[loss.png](loss.png)" not in text and "(loss.png)" in text
    blocks: list[list[int]] = [[]]  # every row of every table has as many cells as its header
    for line in text.splitlines():
        if line.startswith("|"):
            blocks[-1].append(line.replace("\\|", "").count("|"))
        elif blocks[-1]:
            blocks.append([])
    tables = [b for b in blocks if b]
    assert len(tables) >= 5 and all(len(set(b)) == 1 for b in tables), tables


def test_cells_and_tables():
    assert cell("a|b") == "a\\|b" and cell("x\ny") == "x y" and cell(None) == "–" and cell("a\\") == "a\\\\"
    assert table(["a", "b"], [[1, 2]], "rl").splitlines() == ["| a | b |", "| ---: | --- |", "| 1 | 2 |"]


def test_an_interrupted_run_without_rounds_still_reports(tmp_path):
    summary = summarise(
        record(tmp_path, 0, outcome="interrupted", digests=None, contributions=None, chains=[], round_logs={})
    )
    text = render_markdown(summary)
    assert (
        summary["sealed_rounds"] == 0 and summary["loss_start"] is None and summary["bytes"]["ratio"] is None
    )
    assert "No round was sealed." in text and "Not checked" in text and "Interrupted" in text


def test_disagreeing_digests_are_named_in_the_story(tmp_path):
    digests = {
        "agree": False,
        "rounds": [2],
        "peers": [{"name": "edge_1", "params_round": 2, "agree": False, "reason": "digests differ"}],
    }
    text = render_markdown(summarise(record(tmp_path, 3, digests=digests)))
    assert "did not all agree: edge_1 (digests differ)" in text and "**Disagreement**" in text


@pytest.mark.parametrize("rounds", [0, 1, 12])
def test_report_and_plots_are_written_for_any_number_of_rounds(tmp_path, rounds):
    standings = None if rounds == 0 else record(tmp_path, 1).contributions
    path = write_report(record(tmp_path, rounds, contributions=standings, requested_rounds=max(1, rounds)))
    assert path == tmp_path / "report.md" and path.read_text().startswith("# hetnode demo")
    for name in ("loss.png", "bytes.png", "contributions.png"):
        assert (tmp_path / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert json.loads((tmp_path / "summary.json").read_text())["sealed_rounds"] == rounds


def test_digests_agree_only_when_every_replica_matches_its_round():
    history = [entry(r, 5.0) for r in range(3)]
    expected = {"anchor-1": "Qa1", "edge-1": "Qe1"}
    peers = [
        {"peer_id": "Qa1", "params_round": 2, "layer_digests": history[2]["layer_digests"]},
        {"peer_id": "Qe1", "params_round": 1, "layer_digests": history[1]["layer_digests"]},
    ]
    result = compare_digests(peers, history, expected)
    assert result["agree"] and result["rounds"] == [1, 2]
    peers[1] = peers[1] | {"layer_digests": history[2]["layer_digests"]}  # round 1 with round 2's θ
    result = compare_digests(peers, history, expected)
    assert not result["agree"] and "differ" in result["peers"][1]["reason"]
    assert not compare_digests(peers[:1], history, expected)["agree"]  # a replica without a record
    assert not compare_digests([], history, {})["agree"]  # nobody checked is no agreement
    assert hold_round(peers, expected, 1) and not hold_round(peers, expected, 2)


def test_the_live_view_renders_peer_names_as_text_and_prints_plain_lines_off_a_terminal():
    status = {
        "peers": [
            {
                "peer": "Qe1",
                "name": "[bold]edge",
                "role": "stage",
                "link_class": "low",
                "chain": "c1",
                "stage": 0,
                "params_round": 1,
            }
        ],
        "chains": [{"chain": "c1", "members": ["Qe1"], "live": True}],
    }
    console = Console(file=io.StringIO(), width=160, force_terminal=False)
    console.print(render(status, [entry(0, 5.0), entry(1, 4.0)], 8, "http://127.0.0.1:1", 12.0))
    shown = console.file.getvalue()
    assert "[bold]edge" in shown and "sealed 2/8" in shown and "100×" in shown

    line = plain_line(entry(1, 4.0), 2, 8, 60.0)
    assert line.startswith("sealed 2/8 (round #1)  contributors 3") and "eval loss 4.000" in line
    assert "1:00" in line
    unevaluated = {**entry(2, 4.0), "eval_loss": None}  # sealed, evaluated beside the next seals
    assert "eval loss – (#1: 4.000)" in plain_line(unevaluated, 3, 8, 30.0, [entry(0, 5.0), entry(1, 4.0)])
    out = io.StringIO()
    with LiveView(8, None, console=Console(file=io.StringIO(), force_terminal=False), stream=out) as view:
        view.update(None, [entry(0, 5.0)])
        view.update(status, [entry(0, 5.0), entry(1, 4.0)])
        view.update(status, [entry(0, 5.0), entry(1, 4.0)])
    assert [line.split("  ")[0] for line in out.getvalue().splitlines()] == [
        "sealed 1/8 (round #0)",
        "sealed 2/8 (round #1)",
    ]
    out = io.StringIO()  # rounds sealed after the last one the demo waits for are not shown
    with LiveView(2, None, console=Console(file=io.StringIO(), force_terminal=False), stream=out) as view:
        view.update(status, [entry(r, 5.0) for r in range(4)])
    assert [line.split("  ")[0] for line in out.getvalue().splitlines()] == [
        "sealed 1/2 (round #0)",
        "sealed 2/2 (round #1)",
    ]


def test_a_chains_credit_is_split_by_the_rule_and_the_table_and_its_percentages_agree(tmp_path):
    """docs/observability.md, Contribution credit: each stage shows its chain's tokens as replica tokens and
    is credited its part; the parts add up to the chain's tokens; the table says which column is which."""
    summary = summarise(record(tmp_path, 3))
    by_name = {c["name"]: c for c in summary["contributions"]}
    anchor, first, second = by_name["anchor-1"], by_name["edge_1"], by_name["edge|2"]
    # the chain contributed to rounds 1 and 2: both stages trained its 2 × 20,480 tokens
    assert first["replica_tokens"] == second["replica_tokens"] == 2 * 20480
    assert first["tokens"] + second["tokens"] == first["replica_tokens"]  # the chain's, split, not copied
    assert (first["tokens"], second["tokens"]) == (2 * 14884, 2 * 5596)
    assert anchor["tokens"] == anchor["replica_tokens"] == 3 * 20480 and anchor["of_replica"] == 1.0
    total = sum(c["tokens"] for c in summary["contributions"])
    assert total == sum(r["tokens"] for r in summary["rounds"])  # the rounds' credited tokens
    assert sum(c["share"] for c in summary["contributions"]) == pytest.approx(1.0)
    assert first["share"] == pytest.approx(2 * 14884 / total)

    text = render_markdown(summary)
    assert "| " + " | ".join(CONTRIBUTION_HEADERS) + " |" in text
    assert "| replica tokens | credited tokens | of its replica | share |" in text
    rows = [line for line in text.splitlines() if line.startswith(("| 2 | edge", "| 3 | edge"))]
    assert rows == [
        f"| 2 | edge_1 | stage | 2 | 40,960 | 29,768 | 72.7 % | {100 * first['share']:.1f} % |",
        f"| 3 | edge\\|2 | stage | 2 | 40,960 | 11,192 | 27.3 % | {100 * second['share']:.1f} % |",
    ]
    assert "docs/observability.md (Contribution credit)" in text


def test_the_ledgers_rows_less_the_refused_ones_are_the_credit():
    refused = entry(1, 4.0) | {"rejected": {"Qe2": "score"}}
    standings = credit_standings([entry(0, 5.0, with_chain=False), refused], {"Qa1": "anchor-1"})
    assert [(s["name"], s["tokens"], s["replica_tokens"], s["rounds"]) for s in standings] == [
        ("anchor-1", 40960, 40960, 2),
        ("edge_1", 14884, 20480, 1),
    ]
    assert credit_standings([{"credits": None}, {"credits": {"x": "not a row"}}]) == []


def test_results_end_at_the_round_the_demo_finished_at_and_later_seals_are_listed_apart(tmp_path):
    """10 rounds sealed while 8 were asked for: the results are rounds 0-7, their last eval loss is the
    final one, and rounds 8-9 (sealed while the demo checked digests and stopped, the last with the anchor
    alone) are shown apart; the headline is the demo's last printed line."""
    history = [entry(r, 6.0 - 0.25 * r, with_chain=0 < r < 9) for r in range(10)]
    summary = summarise(record(tmp_path, 0, history=history, requested_rounds=8, stopping_at=1085.0))
    assert summary["sealed_rounds"] == 8 and summary["sealed_rounds_in_all"] == 10
    assert [r["round"] for r in summary["rounds"]] == list(range(8))
    assert [r["round"] for r in summary["stopping_rounds"]] == [8, 9]
    assert summary["loss_end"] == 6.0 - 0.25 * 7 and len(summary["eval_loss"]) == 8
    assert {c["name"]: c["rounds"] for c in summary["contributions"]} == {
        "anchor-1": 8,
        "edge_1": 7,
        "edge|2": 7,
    }
    assert summary["bytes"]["total"]["anchor"] == 8 * 50_000

    line = result_line(summary)
    assert line == (
        "finished: 8 of 8 rounds sealed (#0–#7) in 1:35; eval loss 6.000 → 4.250 after round #7; "
        "2 replicas (1 anchor + 1 chain), 3 peers"
    )
    text = render_markdown(summary)
    assert text.startswith(f"# hetnode demo\n\n**{line}**\n")
    assert (
        "Also sealed while the demo checked digests and stopped the peers, and left out of the results: "
        "2 round(s), #8–#9." in text
    )
    assert "Eval loss: 6.000 at the start, 4.250 at the end." in text
    results, stopping = text.split("Sealed while stopping")
    assert "| 8 | 3 (" not in results and "| 8 | 3 (anchor-1, edge_1, edge\\|2) |" in stopping
    assert "| 9 | 1 (anchor-1) |" in stopping

    # interrupted after 3 rounds (sealed at 1000, 1010, 1020), 2 more sealed while stopping: 3 results
    stopped = summarise(record(tmp_path, 0, history=history[:5], outcome="interrupted", stopping_at=1025.0))
    assert stopped["sealed_rounds"] == 3 and len(stopped["stopping_rounds"]) == 2
    assert result_line(stopped).startswith("interrupted: 3 of 3 rounds sealed (#0–#2)")


def test_replicas_count_a_chain_once_and_peers_count_processes():
    counts = swarm_counts(["coordinator", "anchor", "anchor", "stage", "stage"], stages=2)
    assert counts == {"peers": 4, "anchors": 2, "edges": 2, "chains": 1, "replicas": 3}
    assert swarm_counts(["stage"] * 6, stages=3)["replicas"] == 2
