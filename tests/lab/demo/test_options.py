"""`hetnode demo`'s options: the config it runs, the members it starts, and the flags it refuses."""

from __future__ import annotations

from pathlib import Path

import pytest

from hetnode.errors import ConfigError
from hetnode.lab.demo.run import DemoOptions, check_options, prepare_config
from hetnode.lab.demo.swarm import SwarmPlan

CONFIGS = Path(__file__).resolve().parents[3] / "configs"


def options(**changes) -> DemoOptions:
    return DemoOptions(
        **({"config_path": CONFIGS / "tiny.toml", "out": Path("/tmp/x"), "rounds": 8} | changes)
    )


def test_quick_lowers_h_and_chain_stages_sets_the_chain_length():
    assert prepare_config(options(quick=True)).outer.inner_steps == 10
    assert prepare_config(options()).outer.inner_steps == 30
    assert prepare_config(options(stages=4)).pipeline.stages == 4
    small = prepare_config(options(config_path=CONFIGS / "small.toml"))
    assert small.pipeline.stages == 3 and small.data.data_dir == "~/.cache/hetnode"  # defaults kept


def test_members_and_link_rates():
    plan = SwarmPlan(anchors=2, chains=2, stages=2, edge_mbit=20.0)
    names = [m.name for m in plan.members()]
    assert names == ["anchor-1", "anchor-2", "edge-1", "edge-2", "edge-3", "edge-4"]
    assert {m.role for m in plan.members()[2:]} == {"stage"}
    rates = plan.rates()
    assert rates["coordinator"] is None and rates["anchor-1"] is None and rates["edge-4"] == 20.0


def test_chain_workers_pool_the_slowest_stage():
    assert prepare_config(options(workers=3)).pipeline.stage_workers == 3
    plan = SwarmPlan(anchors=1, chains=2, stages=2, edge_mbit=20.0, workers=3)
    assert sum(m.role == "stage" for m in plan.members()) == 2 * (2 + 3 - 1)  # P + N − 1 edges a chain


@pytest.mark.parametrize(
    ("changes", "flag"),
    [
        ({"anchors": -1}, "--anchors/--chains"),
        ({"anchors": 0, "chains": 0}, "--anchors/--chains"),
        ({"rounds": 0}, "--rounds"),
        ({"workers": 0}, "--chain-workers"),
        ({"workers": 3, "stages": 1}, "--chain-workers"),
        ({"edge_mbit": 0.0}, "--edge-mbit"),
        ({"edge_mbit": 1.0}, "--edge-mbit"),  # below stage_min_up_mbps: the edges would idle
    ],
)
def test_impossible_options_are_refused_naming_the_flag(changes, flag):
    config = prepare_config(options())
    with pytest.raises(ConfigError) as info:
        check_options(options(**changes), config)
    assert info.value.path == flag
    check_options(options(), config)  # the defaults are fine


def test_shaped_needs_root_and_says_so_before_anything_starts(monkeypatch, tmp_path):
    from hetnode.lab.demo.run import run_demo
    from hetnode.lab.netlab import hosts as netlab

    monkeypatch.setattr(netlab.os, "geteuid", lambda: 1000)
    with pytest.raises(netlab.LabUnavailable, match="needs root"):
        run_demo(options(shaped=True, out=tmp_path / "out"))
    assert not (tmp_path / "out").exists()
