"""Lab commands refuse plans that cannot form what they measure, say why a running lab stalled, and stop
their children (and the children's children) within a grace period."""

from __future__ import annotations

import dataclasses
import sys
import time
from pathlib import Path

import pytest

from hetnode.config import load_config, replace
from hetnode.errors import ConfigError, HetnodeError
from hetnode.lab.guard import roles_seen
from hetnode.lab.procs import LabProcess, stop_all
from hetnode.lab.proctree import alive, descendants
from hetnode.lab.runs import network, network_plan
from hetnode.lab.scale import calibrate as scale_calibrate
from hetnode.lab.scale.lab_runs import CalibrationPlan

CONFIGS = Path(__file__).resolve().parents[2] / "configs"


def test_a_chain_link_below_the_stage_minimum_is_refused_naming_the_key_and_the_value_needed(tmp_path):
    config = load_config(CONFIGS / "tiny.toml")
    plan = dataclasses.replace(network_plan.plan_for(True), slow_mbit=2.0)
    with pytest.raises(ConfigError) as refused:
        network.run_benchmark(config, plan, tmp_path)  # refused before root is asked for
    assert refused.value.key == "network.stage_min_up_mbps" and refused.value.path == "--slow-mbit"
    assert ">= 5" in str(refused.value) and "stage-1" in str(refused.value)
    assert not (tmp_path / "network-lab").exists()
    network.check_plan(config, dataclasses.replace(plan, slow_mbit=5.0))  # at the minimum: fine
    lowered = replace(config, "network", stage_min_up_mbps=1.0)
    network.check_plan(lowered, plan)  # or with the minimum lowered in the config


def test_a_calibration_plan_that_cannot_run_is_refused(tmp_path):
    small = load_config(CONFIGS / "small.toml")
    # the lab lowers the stage minimum for its slow stages (a link-bound run), never below half their rate:
    # anchors slower than that would still take no role
    with pytest.raises(ConfigError, match="stage_min_up_mbps"):
        scale_calibrate.run_calibration(small, tmp_path, CalibrationPlan(anchor_mbit=2.0))
    with pytest.raises(ConfigError, match="pipeline.stages"):
        scale_calibrate.run_calibration(small, tmp_path, CalibrationPlan(stages=99))
    with pytest.raises(HetnodeError, match="warm-up"):
        scale_calibrate.run_calibration(small, tmp_path, CalibrationPlan(warmup_rounds=0))
    scale_calibrate.check_plan(scale_calibrate.lab_config(small, CalibrationPlan()), CalibrationPlan())


def test_a_stall_names_each_daemons_last_role(tmp_path):
    logs = {
        "stage-1": "12:00:01 x: link up 2.0 / down 2.0 Mbit/s: class slow, role idle (wants idle)\n",
        "stage-2": "12:00:01 x: link up 20.0 / down 20.0 Mbit/s: class low, role idle (wants stage)\n"
        "12:00:09 x: chain c3-ab live: stage 1, layers 2..3\n",
        "anchor-1": "12:00:01 x: link up 1000.0 / down 1000.0 Mbit/s: class high, role anchor\n"
        "12:00:30 x: boundary 7: role idle\n",
    }
    for name, text in logs.items():
        (tmp_path / f"{name}.log").write_text(text)
    roles = roles_seen({name: tmp_path / f"{name}.log" for name in [*logs, "missing"]})
    assert roles["stage-1"] == "idle (wants idle), class slow"
    assert roles["stage-2"] == "stage 1 (chain live), class low"
    assert roles["anchor-1"] == "idle, class high"
    assert roles["missing"] == "no log"


def test_rounds_without_the_watched_peers_are_counted_from_the_last_round_with_them():
    history = [{"contributors": c} for c in (["a"], ["a", "s1", "s2"], ["a"], ["a", "s1"])]
    assert network.rounds_without(history, {"s1", "s2"}) == 2
    assert network.rounds_without(history[:2], {"s1", "s2"}) == 0
    assert network.rounds_without(history, {"nobody"}) == 4


# a process that ignores SIGTERM and has a child of its own that does too (as a daemon with its p2pd)
STUBBORN = (
    "import signal,subprocess,sys,time\n"
    "signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
    "child = subprocess.Popen([sys.executable, '-c', "
    "'import signal,time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(60)'])\n"
    "print('READY child=%d' % child.pid, flush=True)\n"
    "time.sleep(60)\n"
)


def test_stop_all_kills_what_ignores_sigterm_and_its_children_after_one_shared_grace(tmp_path):
    processes = [
        LabProcess(f"p{i}", [sys.executable, "-c", STUBBORN], tmp_path / f"p{i}.log", detach=True)
        for i in range(3)
    ]
    children = [int(p.wait_ready(30)["child"]) for p in processes]
    assert all(child in descendants(p.proc.pid) for p, child in zip(processes, children, strict=True))
    started = time.monotonic()
    stop_all(processes, grace_s=1.0)
    assert time.monotonic() - started < 3.0  # one grace for all three, not one each
    assert all(p.proc.returncode is not None for p in processes)
    deadline = time.monotonic() + 5
    while any(alive(child) for child in children) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not any(alive(child) for child in children)  # the orphans in the group went too
