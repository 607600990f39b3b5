"""`hetnode bench chains` without a lab: its figures from hand-written round logs, histories and status
documents, its plan's refusals, its report's keys and its command line."""

from __future__ import annotations

import dataclasses
import json
from datetime import datetime
from pathlib import Path

import pytest

from hetnode.cli.bench_chains import print_summary
from hetnode.cli.main import build_parser
from hetnode.config import load_config
from hetnode.errors import ConfigError, HetnodeError
from hetnode.lab.runs import chains, chains_plan
from hetnode.lab.runs import chains_figures as fig
from hetnode.lab.runs.chains_report import plot, summarise

TINY = Path(__file__).resolve().parents[2] / "configs" / "tiny.toml"
IDS = {"anchor": "A", "stage-0": "S0", "stage-1a": "S1a", "stage-1b": "S1b"}
TOKENS = 5 * 8 * 128  # H micro-batches of 8 × 128


def stage_round(round_: int, announced: float, train: float = 2.0, tokens: int = TOKENS, **extra) -> dict:
    return {"round": round_, "role": "stage", "train_s": train, "started_at": announced - train,
            "time": announced, "tokens": tokens, "included": True, "seal_wait_s": 0.5} | extra  # fmt: skip


def seal(round_: int, time_: float, *contributors: str, loss: float | None = None, tokens: int = 0) -> dict:
    return {"round": round_, "time": time_, "contributors": list(contributors), "eval_loss": loss,
            "tokens": tokens or 1000 * len(contributors)}  # fmt: skip


def test_the_chains_tokens_per_s_is_its_first_stages_over_the_measured_wall_time():
    # rounds every 4 s, 2 s of training each: round 1 the warm-up, round 6 after the window
    records = [stage_round(r, 100.0 + 4 * r) for r in range(1, 7)]
    figures = fig.chain_tokens_per_s(records, first_round=2, until=120.0)
    # rounds 2..5: from round 2's first micro-batch (106) to round 5's announcement (120)
    assert figures["rounds"] == 4 and figures["first_round"] == 2 and figures["last_round"] == 5
    assert figures["tokens_per_s"] == pytest.approx(4 * TOKENS / 14)
    assert figures["train_tokens_per_s"] == pytest.approx(4 * TOKENS / 8)  # while training
    assert figures["seal_wait_s_p50"] == 0.5
    empty = fig.chain_tokens_per_s(records, first_round=9, until=200.0)
    assert empty["tokens_per_s"] is None and empty["train_tokens_per_s"] is None and empty["rounds"] == 0


def test_a_rounds_rate_is_its_tokens_over_the_seconds_since_the_round_before():
    records = [stage_round(1, 100.0), stage_round(2, 104.0), stage_round(4, 112.0, tokens=2 * TOKENS)]
    series = fig.rate_series(records, t0=100.0)
    assert series == [
        {"t": 4.0, "round": 2, "tokens_per_s": TOKENS / 4},
        {"t": 12.0, "round": 4, "tokens_per_s": 2 * TOKENS / 8},  # a round missed: over the whole gap
    ]


HISTORY = [
    seal(1, 100.0, "A", "S0", "S1a", "S1b"),
    seal(2, 103.0, "A", "S0", "S1a", "S1b"),
    seal(3, 106.0, "A"),  # killed at 104: the chain's round was lost
    seal(4, 109.0, "A"),
    seal(5, 112.0, "A", "S0", "S1b"),
    seal(6, 115.0, "A", "S0", "S1b"),
]


def test_rounds_lost_count_seals_without_the_first_stage_until_it_is_back():
    lost = fig.rounds_without(HISTORY, "S0", 104.0, {"S0"})
    assert lost == {"lost": 2, "back_round": 5, "back_after_s": 8.0}
    assert fig.rounds_without(HISTORY, "S0", 110.0, {"S0"})["lost"] == 0  # back at once
    # a spare: back once a round is sealed with the first stage and the spare together
    assert fig.rounds_without(HISTORY, "S0", 104.0, {"S0", "S1b"})["back_round"] == 5
    never = fig.rounds_without(HISTORY, "S0", 104.0, {"S0", "S9"})
    assert never == {"lost": 2, "back_round": None, "back_after_s": None}  # counted to the end
    assert fig.first_seal_with(HISTORY, {"S0", "S1b"}, after=0.0)["round"] == 1


def test_a_chain_has_recovered_once_a_rounds_rate_is_back_to_the_one_worker_rate():
    # two workers: a round every 2 s; killed at 107; one slow round, then one every 3 s
    records = [stage_round(r, 100.0 + 2 * r) for r in range(1, 4)]  # 102, 104, 106
    records += [stage_round(4, 116.0), stage_round(5, 119.0), stage_round(6, 122.0)]
    one_worker = TOKENS / 3.2
    back = fig.recovery(records, killed_at=107.0, reference=one_worker, boundary_s=4.0, share=0.9)
    # round 4's rate is TOKENS / 10 (< 0.9 × one worker's); round 5's TOKENS / 3 is enough
    assert back["at_round"] == 5 and back["seconds"] == pytest.approx(12.0)
    assert back["boundaries"] == pytest.approx(3.0) and back["reference_tokens_per_s"] == one_worker
    assert fig.recovery(records, 107.0, None, 4.0)["boundaries"] is None  # nothing to compare with
    assert fig.recovery(records, 107.0, 10 * TOKENS, 4.0)["at_round"] is None  # never back


def test_rounds_to_drop_count_seals_from_the_fault_to_the_status_that_shows_the_liar_dropped():
    assert fig.rounds_to_drop(HISTORY, fault_at=101.0, dropped_at=106.5) == 2  # rounds 2 and 3
    assert fig.rounds_to_drop(HISTORY, fault_at=101.0, dropped_at=103.0) == 1  # a seal at the read counts
    assert fig.rounds_to_drop(HISTORY, fault_at=107.0, dropped_at=106.0) == 0  # seen before the estimate
    assert fig.rounds_to_drop(HISTORY, fault_at=101.0, dropped_at=None) is None
    assert (
        fig.rounds_sealed_with(HISTORY, "S1a", 0.0) == 2
        and fig.rounds_sealed_with(HISTORY, "S1a", 101.0) == 1
    )
    assert fig.rounds_sealed_with(HISTORY, "S1b", 0.0, before=106.0) == 2


def test_the_blame_is_timed_by_the_first_stages_log_line():
    near = datetime(2026, 12, 5, 23, 59, 58).timestamp()
    log = (
        "23:59:50 hetnode INFO hetnode.daemon.chain: round 7 applied\n"
        "00:00:03 hetnode WARNING hetnode.daemon.chain_links: chain c2: S1b sent what no honest stage sends: "
        "norm 32x off\n"
        "00:00:09 hetnode WARNING hetnode.daemon.chain_links: chain c2: S1b sent what no honest stage sends\n"
    )
    at = fig.logged_at(log, f"S1b {fig.BLAME_LINE}", near)
    assert at == pytest.approx(datetime(2026, 12, 6, 0, 0, 4).timestamp())  # the next day, end of its second
    assert fig.logged_at(log, f"S1a {fig.BLAME_LINE}", near) is None


STATUS = {
    "chains": [
        {
            "id": "old",
            "live": False,
            "lineage": "c1",
            "workers": [["S0"], ["S1a"]],
            "blamed": [],
            "dropped": {},
        },
        {
            "id": "c2",
            "live": True,
            "lineage": "c1",
            "workers": [["S0"], ["S1a"]],
            "blamed": ["S1b"],
            "dropped": {"S1b": "blamed by S0"},
        },
    ]
}


def test_the_status_gives_the_chains_layout_and_whom_it_dropped():
    chain = fig.chain_of(STATUS)
    assert chain["id"] == "c2" and chain["live"] and chain["lineage"] == "c1"  # the live one
    assert chain["workers"] == [["S0"], ["S1a"]] and chain["blamed"] == ["S1b"]
    assert fig.chain_of(STATUS, first="S1a") is None and fig.chain_of(None) is None
    assert fig.dropped_by_chain(STATUS, "S1b") and not fig.dropped_by_chain(STATUS, "S1a")
    dropped_only = {"chains": [{"blamed": [], "dropped": {"S1b": "lied"}}]}
    assert fig.dropped_by_chain(dropped_only, "S1b") and not fig.dropped_by_chain(None, "S1b")


def test_eval_loss_is_compared_with_the_clean_run_at_equal_sealed_tokens():
    clean = [seal(r, 100.0 + r, "A", "S0", tokens=1000, loss=5.0 - 0.5 * r) for r in range(1, 7)]
    liar = [seal(r, 100.0 + r, "A", "S0", tokens=1500, loss=5.0 - 0.4 * r) for r in range(1, 4)]
    compared = fig.eval_against_clean(liar, clean)
    # the liar's run ends at 4500 tokens (loss 3.8); the clean run is at 4.5 rounds there: 2.75
    assert compared["at_tokens"] == 4500 and compared["eval_loss"] == pytest.approx(3.8)
    assert compared["eval_loss_clean"] == pytest.approx(2.75)
    assert compared["ratio"] == pytest.approx(3.8 / 2.75) and compared["eval_loss_final"] == pytest.approx(
        3.8
    )
    alone = fig.eval_against_clean(liar, None)
    assert alone["eval_loss"] is None and alone["eval_loss_final"] == pytest.approx(3.8)


def test_the_plan_refuses_what_cannot_measure_the_chain():
    config, plan = load_config(TINY), chains_plan.plan_for(quick=True)
    chains_plan.check_plan(config, plan, cores=2)
    chains_plan.check_plan(config, chains_plan.plan_for(quick=False), cores=2)
    with pytest.raises(ConfigError, match="--cases"):
        chains_plan.check_plan(config, dataclasses.replace(plan, cases=("one_worker", "two")), cores=2)
    with pytest.raises(ConfigError, match="network.stage_min_up_mbps"):
        chains_plan.check_plan(config, dataclasses.replace(plan, stage_mbit=2.0), cores=2)
    with pytest.raises(ConfigError, match="--measure"):
        chains_plan.check_plan(config, dataclasses.replace(plan, measure_s=5.0), cores=2)
    with pytest.raises(ConfigError, match="--fault-after"):
        chains_plan.check_plan(config, dataclasses.replace(plan, fault_after_s=0.0), cores=2)
    with pytest.raises(ConfigError, match="--inner-steps"):
        chains_plan.check_plan(config, dataclasses.replace(plan, inner_steps=0), cores=2)
    with pytest.raises(HetnodeError, match="not below the first stage"):
        chains_plan.check_plan(config, dataclasses.replace(plan, worker_cpu=0.5), cores=4)
    with pytest.raises(HetnodeError, match="quotas add up"):
        chains_plan.check_plan(config, plan, cores=1)
    # one_worker alone needs a stage peer fewer
    alone = dataclasses.replace(plan, cases=("one_worker",), anchor_cpu=0.7)
    chains_plan.check_plan(config, alone, cores=2)
    with pytest.raises(HetnodeError, match="quotas add up"):
        chains_plan.check_plan(config, dataclasses.replace(alone, cases=("spare",)), cores=2)


def test_each_case_runs_its_layout_with_fixed_compute_and_the_liar_only_where_it_lies():
    config, plan = load_config(TINY), chains_plan.plan_for(quick=True)
    pooled = chains_plan.case_config(config, plan, "two_workers")
    assert pooled.pipeline.stages == 2 and pooled.pipeline.stage_workers == 2
    o = pooled.outer
    assert o.inner_steps == plan.inner_steps and not o.verify and o.overlap and o.paced
    # a round is a budget of round_s the chain fills with micro-batches, below a cap it never reaches
    assert o.min_round_s == plan.round_s and o.step_cap == plan.max_micro_batches
    assert pooled.network.boundary_s == 4.0 and pooled.network.anchor_min_up_mbps <= plan.anchor_mbit
    assert chains_plan.case_config(config, plan, "spare").pipeline.stage_workers == 1
    one = chains_plan.members(plan, "one_worker")
    assert [(m.name, m.role) for m in one] == [
        ("anchor", "anchor"),
        ("stage-0", "stage"),
        ("stage-1a", "stage"),
    ]
    assert one[1].extra == ("--tflops", "2") and one[2].extra == ("--tflops", "1.9")
    liar = {m.name: m.extra for m in chains_plan.members(plan, "malicious_worker")}
    assert liar["stage-1b"] == ("--tflops", "1.8", "--fault", "grad-scaled", "--fault-after", "80")
    assert "--fault" not in liar["stage-1a"]
    assert all("--fault" not in m.extra for m in chains_plan.members(plan, "two_workers"))
    links = chains_plan.lab_links(plan, "spare")
    assert {2 * (a.delay_ms + b.delay_ms) for a in links.values() for b in links.values()} == {40.0}
    assert links["stage-1b"].up_mbit == 8.0 and links["anchor"].down_mbit == 50.0
    shares = chains_plan.shares(plan, "two_workers")
    # the pool is the bottleneck with one worker and with two: its workers share less than the first stage
    assert (
        shares["stage-1a"] == shares["stage-1b"]
        and shares["stage-1a"] + shares["stage-1b"] < shares["stage-0"]
    )


# --- the report ---------------------------------------------------------------------------------------------


def _run(case: str, period: float, history: list[dict], events: dict | None = None, rounds: int = 10) -> dict:
    first = [stage_round(r, 100.0 + period * r, train=period / 2) for r in range(1, rounds + 1)]
    layout = {"id": "c1", "lineage": "c1", "names": [["stage-0"], ["stage-1a"]]}
    return {
        "case": case,
        "run_name": "tiny",
        "peer_ids": IDS,
        "boundary_s": 4.0,
        "start_round": 1,
        "t0": 100.0 + period,
        "end": 100.0 + period * rounds,
        "events": events or {},
        "layout_before": layout,
        "layout_after": layout,
        "history": history,
        "round_logs": {"stage-0": first, "anchor": [dict(r, role="anchor") for r in first]},
        "digest_checks": [{"name": "anchor", "round": 9, "verdict": "agrees"}],
        "digest_mismatches_logged": {"anchor": 0, "stage-0": 0},
    }


def _seals(period: float, rounds: int, *contributors: str, start: int = 1) -> list[dict]:
    # credited tokens as if every round sealed the same work: the liar's run and the clean one line up
    return [
        seal(r, 100.0 + period * r + 0.5, *contributors, loss=5 - 0.1 * r, tokens=4000)
        for r in range(start, rounds + 1)
    ]


def _runs() -> dict[str, dict]:
    killed = _run(
        "worker_killed", 2.0, _seals(2.0, 12, "A", "S0", "S1a"), {"killed": "stage-1b", "killed_at": 109.0}
    )
    spare = _run(
        "spare",
        3.0,
        _seals(3.0, 3, "A", "S0", "S1a")
        + _seals(3.0, 4, "A", start=4)
        + _seals(3.0, 10, "A", "S0", "S1b", start=5),
        {"killed": "stage-1a", "killed_at": 110.0, "spare": "stage-1b"},
    )
    spare["layout_after"] = {"id": "c2", "lineage": "c1", "names": [["stage-0"], ["stage-1b"]]}
    liar = _run(
        "malicious_worker",
        2.0,
        _seals(2.0, 5, "A", "S0", "S1a", "S1b") + _seals(2.0, 10, "A", "S0", "S1a", start=6),
        {
            "liar": "stage-1b",
            "fault_at": 107.0,
            "dropped_seen_at": 111.0,
            "blame_logged_at": 108.0,
            "fault_clock_from": "daemon.lock",
        },
    )
    return {
        "one_worker": _run("one_worker", 3.0, _seals(3.0, 10, "A", "S0", "S1a")),
        "two_workers": _run("two_workers", 2.0, _seals(2.0, 12, "A", "S0", "S1a", "S1b")),
        "worker_killed": killed,
        "spare": spare,
        "malicious_worker": liar,
    }


REQUIRED = {
    "one_worker": {"tokens_per_s"},
    "two_workers": {"tokens_per_s"},
    "worker_killed": {"sealed_rounds_lost", "boundaries_to_recover"},
    "spare": {"rounds_lost"},
    "malicious_worker": {"rounds_to_drop", "eval_loss", "eval_loss_clean"},
}


def test_the_report_has_the_issues_keys_and_figures(tmp_path: Path, capsys):
    plan = chains_plan.plan_for(quick=True)
    report = summarise(plan, _runs(), "hetnode bench chains --quick")
    for case, keys in REQUIRED.items():
        assert keys <= set(report[case]) and report[case]["error"] is None, case
    assert isinstance(report["digest_disagreements"], int) and report["digest_disagreements"] == 0
    assert report["digest_checks"] == 5 and report["command"] == "hetnode bench chains --quick"
    assert report["plan"]["inner_steps"] == plan.inner_steps and report["config"]["run"] == "tiny"
    assert report["two_over_one_tokens_per_s"] == pytest.approx(1.5)  # a round every 2 s against 3 s
    assert report["worker_killed"]["sealed_rounds_lost"] == 0  # the first stage in every seal
    assert report["spare"]["rounds_lost"] == 1 and report["spare"]["lineage_kept"] is True
    assert report["spare"]["successor"] == [["stage-0"], ["stage-1b"]]
    liar = report["malicious_worker"]
    assert liar["rounds_to_drop"] == 2  # rounds 4 (108.5) and 5 (110.5) between the fault and the read
    assert liar["rounds_to_blame"] == 0 and liar["blamed_after_s"] == 1.0  # caught before round 4 was sealed
    assert liar["liar_rounds_sealed_after_drop"] == 0 and liar["liar_rounds_sealed_before_fault"] == 3
    assert liar["eval_loss"] == pytest.approx(liar["eval_loss_clean"])  # the same losses at the same tokens
    assert report["targets"]["spare_rounds_lost"]["met"] and report["targets"]["digest_disagreements"]["met"]
    assert "history" not in report["runs"]["spare"]  # those stay in the case's run.json
    json.dumps(report)  # plain JSON
    print_summary(report)
    out = capsys.readouterr().out
    assert "rounds_lost 1" in out and "two workers / one: tokens/s 1.50x" in out
    plot(report, tmp_path / "c.png")
    assert (tmp_path / "c.png").stat().st_size > 0


def test_a_case_that_stalled_is_reported_beside_the_ones_that_worked(tmp_path: Path, capsys):
    runs = _runs()
    runs["spare"] = {
        "case": "spare",
        "error": "spare: a round sealed with the chain: not within 150 s\n  ...",
    }
    del runs["two_workers"]  # not run (--cases): malicious_worker has nothing clean to compare with
    report = summarise(chains_plan.plan_for(quick=True), runs)
    assert report["spare"]["rounds_lost"] is None and report["spare"]["error"].startswith("spare:")
    assert (
        report["two_workers"]["error"].startswith("not run") and report["two_over_one_tokens_per_s"] is None
    )
    assert (
        report["malicious_worker"]["eval_loss_clean"] is None
        and report["malicious_worker"]["rounds_to_drop"] == 2
    )
    assert report["targets"]["spare_rounds_lost"]["met"] is None
    print_summary(report)
    assert "not measured: spare: a round sealed with the chain" in capsys.readouterr().out
    plot(report, tmp_path / "c.png")


def test_a_report_is_written_again_from_the_runs_a_benchmark_left(tmp_path: Path):
    plan = chains_plan.plan_for(quick=True)
    runs = _runs()
    chains.write_report(plan, runs, tmp_path, "hetnode bench chains --quick")
    for case, run in runs.items():
        (tmp_path / "work" / case).mkdir(parents=True)
        (tmp_path / "work" / case / chains.RUN_RECORD).write_text(json.dumps(run))
    again = chains.resummarise(tmp_path)
    assert again["command"] == "hetnode bench chains --quick (resummarised)"
    assert again["spare"]["rounds_lost"] == 1 and again["plan"] == dataclasses.asdict(plan)
    with pytest.raises(HetnodeError, match="run the benchmark"):
        chains.resummarise(tmp_path / "elsewhere")


def test_the_command_line_parses():
    args = build_parser().parse_args(["bench", "chains", "--quick", "--out", "x"])
    assert args.quick and args.out == Path("x") and args.cases is None and not args.resummarise
    args = build_parser().parse_args(
        ["bench", "chains", "--cases", "one_worker,spare", "--measure", "60", "--fault-after", "90"]
    )
    assert args.cases == "one_worker,spare" and args.measure == 60.0 and args.fault_after == 90.0
    assert args.out == Path("benchmarks/results/chains")
    args = build_parser().parse_args(
        ["bench", "chains", "--resummarise", "--inner-steps", "8", "--no-progress"]
    )
    assert args.resummarise and args.inner_steps == 8 and args.no_progress
