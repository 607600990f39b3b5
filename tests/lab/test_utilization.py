"""`hetnode bench utilization` without a lab: its figures from hand-written round logs and histories, its
plan's refusals, its report's shape; and, as root, that a CPU quota caps a process and leaves nothing."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from hetnode.cli.bench_utilization import print_summary
from hetnode.cli.main import build_parser
from hetnode.config import load_config
from hetnode.errors import ConfigError, HetnodeError
from hetnode.lab.cpu_quota import CPU_ROOT, CpuQuotas, parse_cpu_stat, quota_us, stray_folders
from hetnode.lab.runs import utilization, utilization_plan
from hetnode.lab.runs import utilization_figures as fig
from hetnode.lab.runs.utilization_report import left_out_reasons, plot, since_first_sealed, summarise
from hetnode.lab.swarm import merged_history

TINY = Path(__file__).resolve().parents[2] / "configs" / "tiny.toml"
NEEDS_CGROUP = pytest.mark.skipif(
    os.geteuid() != 0 or not (CPU_ROOT / "cpu.cfs_quota_us").exists(),
    reason="needs root and the cgroup-v1 cpu controller",
)


def rec(round_: int, started: float, train: float, announced: float, **extra) -> dict:
    return {"round": round_, "role": "anchor", "train_s": train, "started_at": started, "time": announced,
            "tokens": 1000, "included": True, "seal_wait_s": 0.0, "apply_s": 0.0} | extra  # fmt: skip


def test_utilisation_is_inner_step_seconds_over_the_wall_seconds_of_the_measured_rounds():
    # lockstep: train 6 s, sync 4 s: rounds at 0-6, 10-16, 20-26
    lockstep = [rec(r, 10.0 * r, 6.0, 10.0 * r + 6) for r in range(3)]
    assert fig.utilization(lockstep) == pytest.approx(18 / 26)
    # overlap: each round starts when the one before announced; one stood still 1 s waiting
    overlap = [rec(0, 0.0, 6.0, 6.0), rec(1, 6.0, 6.0, 13.0, train_wait_s=1.0), rec(2, 13.0, 6.0, 19.0)]
    assert fig.utilization(overlap) == pytest.approx(18 / 19)
    assert fig.utilization(lockstep[:1]) is None  # one round has no wall time between rounds
    # a log written before daemons filled started_at: the round began train_s before it announced
    old = [dict(r, started_at=0.0) for r in lockstep]
    assert fig.round_start(old[1]) == 10.0 and fig.utilization(old) == pytest.approx(18 / 26)


def test_a_replicas_figures_skip_the_warm_up_and_what_came_after_the_budget():
    records = [rec(r, 10.0 * r, 6.0, 10.0 * r + 6, included=r != 3) for r in range(8)]
    kept = fig.measured(records, first_round=2, until=56.0)
    assert [r["round"] for r in kept] == [2, 3, 4, 5]
    figures = fig.replica_figures("anchor-1", "anchor", kept)
    assert figures["compute_utilization"] == pytest.approx(24 / 36)
    assert figures["tokens_per_s"] == pytest.approx(4000 / 36)  # per wall second, waiting included
    assert figures["rounds_included"] == 3 and figures["rounds"] == 4 and not figures["overlap_logged"]
    empty = fig.replica_figures("stage-2", "stage", [])
    assert empty["compute_utilization"] is None and empty["tokens_per_s"] is None and empty["rounds"] == 0
    anchors = [{"role": "anchor", "compute_utilization": u} for u in (0.6, 0.7, 0.8)]
    assert fig.outside_share([*anchors, empty]) == pytest.approx(0.3)  # the stage does not count
    assert fig.outside_share([empty], role="stage") is None


HISTORY = [
    {"round": 1, "contributors": ["a1", "a2"], "tokens": 2000, "time": 100.0, "eval_loss": 5.0},
    {"round": 2, "contributors": ["a1", "a2", "s1", "s2"], "tokens": 3000, "time": 110.0, "eval_loss": 4.5},
    {"round": 3, "contributors": ["a1", "a2", "s1", "s2"], "tokens": 3000, "time": 118.0, "eval_loss": 4.0},
    {"round": 4, "contributors": ["a1", "s1", "s2"], "tokens": 2000, "time": 128.0, "eval_loss": None},
    {"round": 5, "contributors": ["a1", "a2", "s1", "s2"], "tokens": 3000, "time": 134.0, "eval_loss": 3.5},
]


def test_a_late_members_figures_also_count_from_the_first_seal_that_took_its_work():
    records = [rec(r, 10.0 * r, 6.0 if r >= 2 else 1.0, 10.0 * r + 6) for r in range(1, 6)]
    late = since_first_sealed("s1", HISTORY, records)  # s1 first sealed in round 2, then in every one
    assert late["first_sealed_round"] == 2 and late["seal_share_since_in"] == 1.0
    assert late["compute_utilization_since_in"] == pytest.approx(24 / 36)
    gaps = since_first_sealed("a2", HISTORY, records)  # in from round 1, left out of round 4
    assert gaps["first_sealed_round"] == 1 and gaps["seal_share_since_in"] == pytest.approx(4 / 5)
    never = since_first_sealed("x9", HISTORY, records)
    assert never == dict.fromkeys(never) and set(never) == set(late)


def test_the_swarm_is_measured_from_the_first_seal_once_every_replica_runs():
    logs = {"a1": [rec(1, 95.0, 4.0, 99.0), rec(2, 101.0, 4.0, 105.0)], "s1": [rec(2, 103.0, 4.0, 107.0)]}
    assert fig.start_seal(HISTORY, logs)["round"] == 2  # the first seal (110 s) once s1 had announced (107 s)
    assert fig.start_seal(HISTORY, {**logs, "s2": []}) is None and fig.start_seal(HISTORY, {}) is None
    seals = fig.measured_seals(HISTORY, first_round=3, until=130.0)
    assert [e["round"] for e in seals] == [3, 4]
    assert fig.seal_intervals(seals) == [10.0] and fig.p50([10.0, 2.0, 6.0]) == 6.0
    assert fig.swarm_tokens_per_s(seals) == pytest.approx(2000 / 10)  # the first seal opens the window
    curve = fig.loss_curve(HISTORY, t0=110.0)
    assert [p["wall_s"] for p in curve] == [-10.0, 0.0, 8.0, 24.0]  # round 4 was not evaluated
    assert [p["tokens"] for p in curve] == [2000, 5000, 8000, 13000]


def test_a_seals_tokens_are_the_steps_it_counted_not_its_credit():
    # paced: a fast anchor's 20 steps, a slow one's 2, a chain of two stages at 12 micro-batches; the
    # credit (tokens) stops at H = 5 steps and is scaled by earned weight
    entry = {"steps": {"a1": 20, "a3": 2, "s1": 12, "s2": 12}, "tokens": 1234, "time": 0.0}
    tokens = fig.sealed_tokens(100, {"s1": 0.5, "s2": 0.5})
    assert tokens(entry) == 100 * (20 + 2 + 12)  # the chain once
    assert tokens({"tokens": 1234}) == fig.credited_tokens(entry) == 1234  # no steps: the credit
    seals = [dict(entry, time=0.0), dict(entry, time=10.0)]
    assert fig.swarm_tokens_per_s(seals, tokens) == pytest.approx(3400 / 10)
    assert fig.swarm_tokens_per_s(seals) == pytest.approx(1234 / 10)
    assert [p["tokens"] for p in fig.loss_curve([dict(entry, eval_loss=3.0)], 0.0, tokens)] == [3400]


def test_losses_are_compared_where_both_rules_reached():
    assert fig.interpolate([(0.0, 4.0), (10.0, 2.0)], 2.5) == pytest.approx(3.5)
    assert fig.interpolate([(0.0, 4.0), (10.0, 2.0)], 11.0) is None
    curves = {
        "lockstep": [
            {"tokens": 0.0, "wall_s": 0.0, "loss": 5.0},
            {"tokens": 100.0, "wall_s": 50.0, "loss": 3.0},
        ],
        "overlap": [
            {"tokens": 0.0, "wall_s": 0.0, "loss": 5.0},
            {"tokens": 200.0, "wall_s": 40.0, "loss": 2.0},
        ],
    }
    at_tokens = fig.loss_at_equal(curves, "tokens")
    assert at_tokens["at"] == 100.0 and at_tokens["loss"] == {"lockstep": 3.0, "overlap": pytest.approx(3.5)}
    at_wall = fig.loss_at_equal(curves, "wall_s")
    assert at_wall["at"] == 40.0 and at_wall["loss"]["lockstep"] == pytest.approx(3.4)
    apart = {"lockstep": [{"tokens": 0.0, "loss": 5.0}], "overlap": [{"tokens": 9.0, "loss": 4.0}]}
    assert fig.loss_at_equal(apart, "tokens")["at"] is None
    assert fig.loss_at_equal({"lockstep": [], "overlap": curves["overlap"]}, "tokens")["at"] is None


def _rule(util: float, tokens_per_s: float, loss_tokens: float, loss_wall: float, seal: float) -> dict:
    return {
        "replicas": [
            {"role": "anchor", "compute_utilization": util},
            {"role": "stage", "compute_utilization": 0.2},
        ],
        "swarm_tokens_per_s": tokens_per_s,
        "eval_loss_at_equal_tokens": loss_tokens,
        "eval_loss_at_equal_wall": loss_wall,
        "seal_to_seal_s": seal,
        "seal_to_seal_s_no_verify": seal / 1.05,
        "digest_disagreements": 0,
    }


def test_targets_hold_as_the_issue_states_them():
    ratios, targets = fig.judge(
        {"lockstep": _rule(0.5, 1000, 3.0, 3.3, 10), "overlap": _rule(0.93, 1600, 3.03, 3.1, 7)}
    )
    assert ratios["swarm_tokens_per_s"] == pytest.approx(1.6)
    assert ratios["anchor_utilization"] == pytest.approx(0.93 / 0.5)
    assert all(t["met"] for t in targets.values()), targets
    _, missed = fig.judge(
        {"lockstep": _rule(0.5, 1000, 3.0, 3.0, 10), "overlap": _rule(0.5, 1000, 3.2, 3.0, 10)}
    )
    assert {name for name, t in missed.items() if not t["met"]} == {
        "anchor_utilization_overlap", "swarm_tokens_per_s_ratio", "eval_loss_at_equal_tokens_ratio",
        "eval_loss_at_equal_wall_ratio",
    }  # fmt: skip
    unmeasured = _rule(None, None, None, None, 10) | {
        "replicas": [{"role": "anchor", "compute_utilization": None}]
    }
    _, unknown = fig.judge({"lockstep": unmeasured, "overlap": unmeasured})
    assert unknown["anchor_utilization_overlap"]["met"] is None


def _run(label: str, overlap: bool, logged_overlap: bool, shift: float) -> dict:
    roles = {"anchor-1": "anchor", "anchor-2": "anchor", "stage-1": "stage", "stage-2": "stage"}
    logs = {
        name: [
            rec(r, 10.0 * r + shift, 6.0, 10.0 * r + 6 + shift, role=role, overlap=logged_overlap)
            for r in range(1, 7)
        ]
        for name, role in roles.items()
    }
    history = [{"round": r, "contributors": ["x"], "tokens": 4000, "time": 10.0 * r + 8 + shift,
                "eval_loss": 5.0 - 0.1 * r, "verify_seconds": 0.5} for r in range(1, 7)]  # fmt: skip
    return {"label": label, "overlap": overlap, "verify": True, "budget_s": 50.0, "start_round": 1,
            "t0": 18.0 + shift, "end": 68.0 + shift, "history": history, "round_logs": logs,
            "digest_checks": [{"replica": "anchor-1", "params_round": 6, "verdict": "agrees"}],
            "digest_mismatches_logged": dict.fromkeys(logs, 0)}  # fmt: skip


def test_the_report_holds_both_rules_the_run_without_verification_and_says_when_overlap_was_not_real(
    capsys: pytest.CaptureFixture,
):
    plan = utilization_plan.plan_for(quick=True)
    runs = {"lockstep": _run("lockstep", False, False, 0.0), "overlap": _run("overlap", True, False, 1.0)}
    runs["overlap-no-verify"] = _run("overlap-no-verify", True, False, 2.0)
    report = summarise(load_config(TINY), plan, runs)
    lock = report["rules"]["lockstep"]
    assert [r["name"] for r in lock["replicas"]] == ["anchor-1", "anchor-2", "stage-1", "stage-2"]
    assert set(lock["replicas"][0]) >= {
        "name",
        "role",
        "compute_utilization",
        "tokens_per_s",
        "rounds_included",
    }
    assert lock["replicas"][0]["rounds"] == 4  # rounds 3..6 (warm-up 1, 2), all announced by the end
    assert lock["seal_to_seal_s"] == 10.0 and lock["seal_to_seal_s_no_verify"] is None
    assert report["rules"]["overlap"]["seal_to_seal_s_no_verify"] == 10.0
    assert lock["eval_loss_at_equal_tokens"] == pytest.approx(4.4)  # both sealed the same tokens
    assert report["ratios"]["eval_loss_at_equal_tokens"] == pytest.approx(1.0)
    assert lock["digest_disagreements"] == 0 and report["targets"]["digest_disagreements"]["met"]
    assert not report["overlap_is_real"] and "lockstep" in report["note"]
    assert report["H_check"]["lockstep_anchor_sync_share"] == pytest.approx(1 - 24 / 36)  # train 6 s of 10
    print_summary(report)  # the command's table reads every field it needs
    assert "anchor-1" in capsys.readouterr().out
    runs["overlap"] = _run("overlap", True, True, 1.0)
    assert summarise(load_config(TINY), plan, runs)["note"] is None


def test_a_cap_sweep_reports_each_caps_trade_against_lockstep_and_overlap():
    rules = {
        "lockstep": _rule(0.5, 100.0, 4.0, 4.0, 10),
        "overlap": _rule(0.9, 150.0, 4.1, 3.9, 10),
        "paced+overlap": _rule(0.95, 240.0, 4.4, 3.96, 10),
        "paced+overlap@2H": _rule(0.8, 180.0, 4.12, 3.8, 10),
    }
    sweep = fig.cap_sweep(rules, cap_ratio=4)
    assert list(sweep) == ["paced+overlap@2H", "paced+overlap"]  # by cap
    two, four = sweep["paced+overlap@2H"], sweep["paced+overlap"]
    assert (two["cap"], four["cap"]) == (2, 4)
    assert two["swarm_tokens_per_s_over_overlap"] == pytest.approx(1.2)
    assert four["eval_loss_at_equal_tokens_over_lockstep"] == pytest.approx(1.1)
    assert two["eval_loss_at_equal_wall_over_lockstep"] == pytest.approx(0.95)
    assert four["min_anchor_utilization"] == 0.95
    assert fig.cap_sweep({"lockstep": rules["lockstep"]}, 4) == {}


def test_a_report_is_written_again_from_the_runs_a_benchmark_left(tmp_path: Path):
    plan = dataclasses.replace(utilization_plan.plan_for(quick=True), cap_ratio=3, extra_caps=(2,))
    runs = {"lockstep": _run("lockstep", False, False, 0.0), "overlap": _run("overlap", True, True, 1.0)}
    runs["paced+overlap@2H"] = _run("paced+overlap@2H", True, True, 1.5)  # an extra cap: reported, plotted
    first = utilization.write_report(load_config(TINY), plan, runs, tmp_path, "hetnode bench utilization x")
    for label, run in runs.items():
        (tmp_path / "work" / label).mkdir(parents=True)
        (tmp_path / "work" / label / utilization.RUN_RECORD).write_text(json.dumps(run))
    (tmp_path / "utilization.png").unlink()
    again = utilization.resummarise(load_config(TINY), tmp_path)
    assert again["rules"] == json.loads(json.dumps(first["rules"])) and again["plan"]["cap_ratio"] == 3
    assert list(again["rules"]) == ["lockstep", "overlap", "paced+overlap@2H"]
    assert again["cap_sweep"]["paced+overlap@2H"]["cap"] == 2 and list(again["plan"]["extra_caps"]) == [2]
    assert again["command"] == "hetnode bench utilization x (resummarised)"
    assert (tmp_path / "utilization.png").exists()
    with pytest.raises(HetnodeError, match="no run.json"):
        utilization.resummarise(load_config(TINY), tmp_path / "work" / "lockstep")


def test_a_coordinator_that_evaluates_beside_the_seal_has_its_evaluation_folded_into_the_seal():
    rows = [
        {"round": 1, "contributors": ["a"], "time": 10.0, "eval_loss": None},
        {"round": 2, "contributors": ["a"], "time": 20.0, "eval_loss": None},
        {"round": 1, "evaluated": True, "eval_loss": 4.0, "verify_seconds": 0.3},
        {"round": 9, "evaluated": True, "eval_loss": 1.0},  # no seal line before it: dropped
    ]
    merged = merged_history(rows)
    assert [(e["round"], e["eval_loss"], e["time"]) for e in merged] == [(1, 4.0, 10.0), (2, None, 20.0)]


def test_the_plan_refuses_what_cannot_measure_utilisation():
    config, plan = load_config(TINY), utilization_plan.plan_for(quick=True)
    utilization_plan.check_plan(config, plan, cores=2)
    with pytest.raises(ConfigError, match="network.stage_min_up_mbps"):
        utilization_plan.check_plan(config, dataclasses.replace(plan, stage_mbit=2.0), cores=2)
    with pytest.raises(ConfigError, match="--budget"):
        utilization_plan.check_plan(config, dataclasses.replace(plan, budget_s=10.0), cores=2)
    with pytest.raises(HetnodeError, match="quotas add up"):
        utilization_plan.check_plan(config, dataclasses.replace(plan, replica_cpu=0.5), cores=2)
    with pytest.raises(ConfigError, match="--rules"):
        utilization_plan.check_plan(config, dataclasses.replace(plan, rules=("lockstep", "paced")), cores=2)
    with pytest.raises(ConfigError, match="--cap"):
        utilization_plan.check_plan(config, dataclasses.replace(plan, extra_caps=(2, 0)), cores=2)
    capped = utilization_plan.lab_config(
        config, plan, overlap=True, verify=True, schedule="paced", cap_ratio=2
    )
    assert capped.outer.max_inner_steps == 2 * plan.inner_steps
    lab = utilization_plan.lab_config(config, plan, overlap=True, verify=False)
    assert lab.outer.max_inner_steps == plan.cap_ratio * plan.inner_steps
    assert lab.outer.overlap and not lab.outer.verify and lab.outer.inner_steps == plan.inner_steps
    assert lab.network.anchor_min_up_mbps <= plan.anchor_mbit  # 50 Mbit/s anchors are anchors here
    links = utilization_plan.lab_links(plan)
    assert {2 * (a.delay_ms + b.delay_ms) for a in links.values() for b in links.values()} == {40.0}
    assert links["stage-1"].up_mbit == 8.0 and links["anchor-2"].down_mbit == 50.0


def test_the_command_line_parses():
    args = build_parser().parse_args(["bench", "utilization", "--quick", "--inner-steps", "12", "--out", "x"])
    assert args.quick and args.inner_steps == 12 and args.out == Path("x")
    args = build_parser().parse_args(["bench", "utilization", "--resummarise", "--cap", "3", "--out", "x"])
    assert args.resummarise and args.cap == 3
    args = build_parser().parse_args(
        ["bench", "utilization", "--rules", "lockstep,overlap,paced+overlap", "--caps", "2,3"]
    )
    assert args.rules == "lockstep,overlap,paced+overlap" and args.caps == "2,3"


def test_a_quota_is_a_share_of_the_period():
    assert quota_us(0.3) == 30_000 and quota_us(1.5) == 150_000
    with pytest.raises(ValueError):
        quota_us(0.0)
    text = "nr_periods 200\nnr_throttled 50\nthrottled_time 2500000000\nnr_bursts 0\n"
    assert parse_cpu_stat(text) == {"throttled_share": 0.25, "throttled_s": 2.5}


@NEEDS_CGROUP
def test_a_process_under_a_quota_gets_its_share_and_the_folder_goes_with_the_lab():
    busy = "import time\nend = time.time() + 1.5\nwhile time.time() < end: pass\nprint(time.process_time())"
    with CpuQuotas({"busy": 0.25}) as quotas:
        started = time.time()
        out = subprocess.run(
            quotas.prefix("busy") + [sys.executable, "-c", busy], capture_output=True, text=True, timeout=30
        )
        wall = time.time() - started
        folder = quotas.folders["busy"]
        assert (folder / "cpu.cfs_quota_us").read_text().strip() == "25000"
        throttled = quotas.throttling("busy")
    cpu = float(out.stdout)
    assert cpu < 0.45 * wall, f"{cpu:.2f} s of CPU in {wall:.2f} s under a quarter of a core"
    # held back in most periods, unless a loaded machine gave it less than its quota anyway
    assert throttled is not None and (throttled["throttled_share"] > 0.5 or cpu < 0.2 * wall)
    assert not folder.exists() and folder not in stray_folders()


def test_a_run_that_stalled_is_reported_beside_the_ones_that_worked(tmp_path: Path, capsys):
    runs = {
        "lockstep": _run("lockstep", False, False, 0.0),
        "overlap": {"label": "overlap", "error": "overlap: the anchors trained and synced no round\n  ..."},
        "overlap-no-verify": {"label": "overlap-no-verify", "error": "stalled"},
    }
    report = summarise(load_config(TINY), utilization_plan.plan_for(quick=True), runs)
    assert report["rules"]["overlap"]["error"].startswith("overlap:")
    assert report["rules"]["lockstep"]["replicas"][0]["rounds"] == 4 and report["equal_tokens_at"] is None
    assert report["targets"]["swarm_tokens_per_s_ratio"]["met"] is None
    assert report["no_verify"]["seal_to_seal_s"] is None
    print_summary(report)
    assert "overlap: not measured" in capsys.readouterr().out
    plot(report, tmp_path / "u.png")
    assert (tmp_path / "u.png").stat().st_size > 0


def test_a_replica_left_out_of_a_seal_is_reported_with_the_reason():
    seals = [
        {"contributors": ["a"], "excluded": ["s"], "rejected": {"s": "score"}},
        {"contributors": ["a"], "excluded": ["s"], "rejected": {}},  # not screened: late or unchecked
        {"contributors": ["a", "s"], "excluded": [], "rejected": {}},
        {"contributors": ["a"], "excluded": ["s"], "rejected": {"s": "score"}},
    ]
    assert left_out_reasons("s", seals) == {"score": 2, "late": 1}
    assert left_out_reasons("a", seals) == {}
