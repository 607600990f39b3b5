"""The benchmark runners work end to end on tiny plans and write the JSON and PNG they promise."""

import json
from pathlib import Path

import pytest

from hetnode.config import Config, replace
from hetnode.lab.experiments import sparseloco, staleness, subspace
from hetnode.lab.sim.simulation import SyncMethod

pytestmark = pytest.mark.slow


def test_sparseloco_bench_side_by_side(tiny_config: Config, tmp_path: Path):
    methods = (
        SyncMethod("ddp", "ddp", inner_steps=5),
        SyncMethod("diloco", "diloco", inner_steps=5),
        SyncMethod("sl", "sparseloco", inner_steps=5, topk=64),
    )
    plan = sparseloco.BenchPlan(replicas=2, steps=10, batch_size=2, methods=methods)
    report = sparseloco.run_benchmark(tiny_config, plan, tmp_path, progress=False)
    saved = json.loads((tmp_path / "sparseloco.json").read_text())
    assert saved["methods"].keys() == {"ddp", "diloco", "sl"}
    assert (tmp_path / "sparseloco.png").stat().st_size > 1000
    sl, diloco = report["methods"]["sl"], report["methods"]["diloco"]
    assert sl["compression_vs_dense_fp32"] > 80
    assert diloco["compression_vs_dense_fp32"] == pytest.approx(1.0, rel=0.01)
    assert report["methods"]["ddp"]["syncs_per_round"] == 5 and sl["rounds"] == 2


def test_subspace_bench_reports_bytes_per_ratio(tiny_config: Config, tmp_path: Path):
    plan = subspace.SubspacePlan(steps=4, inner_steps=4, batch_size=2)
    report = subspace.run_subspace(tiny_config, plan, tmp_path, progress=False)
    runs = report["runs"]
    assert (tmp_path / "subspace.png").stat().st_size > 1000
    # a dense chain sends fp32 activations (as a daemon's does), a compressed one bf16 coefficients
    dense = runs["mixed-dense"]["activation_bytes_per_token_per_boundary"]
    for ratio in subspace.RATIOS:
        compressed = runs[f"selective-{ratio}x"]["activation_bytes_per_token_per_boundary"]
        assert dense / compressed == pytest.approx(2 * ratio, rel=0.1)
        assert 0 < runs[f"everything-{ratio}x"]["projection_overhead"] < 0.5


def test_staleness_bench_records_delays(tiny_config: Config, tmp_path: Path):
    config = replace(tiny_config, "inner", rotation_refresh=2)
    plan = staleness.StalenessPlan(steps=4, batch_size=2, eval_every=2)
    report = staleness.run_staleness(config, plan, tmp_path, progress=False)
    assert (tmp_path / "staleness.png").stat().st_size > 1000
    for depth in staleness.DEPTHS:
        for optimizer in staleness.OPTIMIZERS:
            run = report["runs"][f"P{depth}-{optimizer}"]
            assert run["max_delay"] == min(depth - 1, plan.steps - 1)
            assert [step for step, _ in run["curve"]] == [0, 2, 4]


def test_sparseloco_plan_keeps_only_the_named_methods():
    from hetnode.errors import ConfigError
    from hetnode.lab.experiments.sparseloco import plan_for

    plan = plan_for(True, 300, ("diloco-H30", "sparseloco-k64-H30"))
    assert [m.name for m in plan.methods] == ["diloco-H30", "sparseloco-k64-H30"] and plan.steps == 300
    assert len(plan_for(True).methods) == 7
    with pytest.raises(ConfigError, match="unknown"):
        plan_for(True, None, ("sparseloco-k999",))


def test_subspace_subset_runs_and_plots_only_what_was_asked(tiny_config: Config, tmp_path: Path):
    plan = subspace.plan_for(True, 4, ("replicas", "selective-16x"))
    plan = subspace.SubspacePlan(steps=4, inner_steps=4, batch_size=2, runs=plan.runs)
    report = subspace.run_subspace(tiny_config, plan, tmp_path, progress=False)
    assert report["runs"].keys() == {"replicas", "selective-16x"}
    assert 0 < report["runs"]["selective-16x"]["projection_overhead"] < 0.5
    assert (tmp_path / "subspace.png").stat().st_size > 1000
    assert len(subspace.plan_for(False).runs) == len(subspace.run_names()) == 12


def test_subspace_plan_rejects_unknown_runs():
    from hetnode.errors import ConfigError

    with pytest.raises(ConfigError, match="unknown"):
        subspace.plan_for(False, None, ("selective-5x",))


def test_staleness_plan_eval_resolution():
    assert staleness.plan_for(False).eval_every == 20
    assert staleness.plan_for(True).eval_every == 15
    assert staleness.plan_for(False, 160, (8,), ("adamw",), eval_every=10).eval_every == 10
    with pytest.raises(ValueError, match="eval_every"):
        staleness.plan_for(False, eval_every=0)


@pytest.mark.parametrize(
    ("flags", "named"),
    [
        (["--eval-every", "0"], "--eval-every"),
        (["--depths", "two"], "--depths"),
        (["--depths", "3"], "--depths"),
    ],
)
def test_staleness_cli_names_the_bad_flag(flags, named, tmp_path, capsys):
    from hetnode.cli.main import EXIT_USAGE, main

    assert main(["bench", "staleness", "--out", str(tmp_path), *flags]) == EXIT_USAGE
    error = capsys.readouterr().err
    assert named in error and "Traceback" not in error
    assert not (tmp_path / "staleness.json").exists()


def test_every_subspace_run_name_maps_to_its_swarm():
    plan = subspace.plan_for(True, 30)
    for name in subspace.run_names():
        subspace.run_case(name, plan, 256)  # each name the bench offers can be built
    swarm, rank = subspace.run_case("everything-16x", plan, 256)
    assert swarm.mode == "everything" and rank == subspace.rank_for(256, 16)
    swarm, rank = subspace.run_case("replicas", plan, 256)
    assert swarm.anchors == plan.anchors + plan.chains and rank is None
