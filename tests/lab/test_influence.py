"""The influence measurement (docs/security.md, "Steer the update"): attackers are valid payloads; each rule
bounds them as claimed."""

import json
from pathlib import Path

import pytest
import torch

from hetnode.algo.aggregate import AGGREGATION_RULES, aggregate_sparse, contribution_parts
from hetnode.algo.sparseloco import SparseLoCoCodec
from hetnode.config import Config
from hetnode.errors import ConfigError
from hetnode.lab.experiments import influence, influence_attacks, influence_weighted
from hetnode.lab.experiments.sparseloco import plan_for as sparseloco_plan

SHAPES = {"w": (128, 128), "b": (128,)}


def _honest(count: int = 4) -> list:
    """Correlated pseudo-gradients (a shared direction plus each peer's noise), through the real codec."""
    gen = torch.Generator().manual_seed(7)
    codec = SparseLoCoCodec()
    common = {n: torch.randn(s, generator=gen) for n, s in SHAPES.items()}
    out = []
    for i in range(count):
        dense = {n: common[n] + torch.randn(s, generator=gen) for n, s in SHAPES.items()}
        out.append((f"peer-{i}", {n: codec.sparse(codec.compress(t)) for n, t in dense.items()}))
    return out


def test_parts_add_up_to_the_aggregate():
    honest = _honest(5)
    for rule in AGGREGATION_RULES:
        parts = contribution_parts(honest, SHAPES, rule=rule)
        delta = aggregate_sparse(honest, SHAPES, rule=rule)
        for name, shape in SHAPES.items():
            total = torch.zeros(shape).reshape(-1)
            for who, _ in honest:
                total.index_add_(0, *parts[who][name])
            assert torch.allclose(total.reshape(shape), delta[name], atol=1e-6), (rule, name)


def test_each_rule_bounds_the_attackers_as_documented():
    honest = _honest(4)
    plan = influence.InfluencePlan(replicas=4, rounds=1, batch_size=1)
    measured = influence.measure_round(honest, SHAPES, plan)
    assert measured.keys() == set(AGGREGATION_RULES)
    mean, selectors, trimmed = measured["mean"], measured["selectors"], measured["trimmed"]
    # the plain mean: one identity at the (raised) median norm holds about 1/(R+1) of the update's norm,
    # k aligned Sybils about k/(R+k)
    for k in (1, 2):
        worst = max(s[k]["share"] for s in mean["by_strategy"].values() if k in s)
        assert worst == pytest.approx(k / (4 + k), rel=0.15)
    # per-selector averaging: one identity on a support nobody chose moves Δ by a whole median norm
    assert selectors["by_strategy"]["disjoint"][1]["push"] == pytest.approx(1.0, rel=0.2)
    assert mean["by_strategy"]["disjoint"][1]["push"] < 0.5
    # the trimmed mean drops a lone selector's values, and Sybils spread one per coordinate
    assert trimmed["by_strategy"]["disjoint"][1]["share"] == 0.0
    assert trimmed["by_strategy"]["disjoint-split"][2]["share"] == 0.0
    for rule in measured.values():
        assert 0 < rule["honest_share_max"] < 1


def test_attackers_are_valid_payloads():
    codec = SparseLoCoCodec()
    honest = _honest(4)
    for strategy in influence_attacks.STRATEGIES:
        sybils = influence_attacks.attack(honest, SHAPES, codec, strategy, 2, seed=1)
        assert [who for who, _ in sybils] == ["~sybil-000", "~sybil-001"]
        for _, tensors in sybils:
            for name, (idx, vals) in tensors.items():
                assert idx.numel() == codec.grid(SHAPES[name]).total_selected
                assert torch.unique(idx).numel() == idx.numel() and bool(torch.isfinite(vals).all())
    split = influence_attacks.attack(honest, SHAPES, codec, "disjoint-split", 2, seed=1)
    assert not set(split[0][1]["w"][0].tolist()) & set(split[1][1]["w"][0].tolist())
    same = influence_attacks.attack(honest, SHAPES, codec, "disjoint", 2, seed=1)
    assert torch.equal(same[0][1]["w"][0], same[1][1]["w"][0])


@pytest.fixture(scope="module")
def weighted() -> dict:
    """measure_weighted on the synthetic round: R = 4 honest at F = 8, Sybils with h in (0, 1, 2, 4, 8)."""
    plan = influence.InfluencePlan(replicas=4, rounds=1, batch_size=1)
    return influence_weighted.measure_weighted(_honest(4), SHAPES, plan, full=8)


def test_weights_bound_the_sybils_as_stated(weighted):
    assert [influence_weighted.earned_weight(h, 8) for h in (0, 1, 2, 4, 8, 10)] == [0, 1, 2, 4, 8, 8]
    assert influence_weighted.stated_bound(5, 1, 4, 8) == 5 / 37
    mean = weighted["rules"]["mean"]
    for rule in AGGREGATION_RULES:  # on probation: not in the aggregate at all
        assert all(cell["share"] == 0.0 for cell in weighted["rules"][rule]["0"].values())
    # five fresh Sybils (weight 1) beside four honest at full weight: 5 / (5 + 32) of the weight, and of
    # the update's norm under "mean" (the target: under 10 % takes k·w < R·F / 9)
    assert mean["1"]["5"]["bound"] == pytest.approx(5 / 37)
    assert mean["1"]["5"]["share"] < 0.16
    for h in ("1", "2", "4"):  # the median norm stays an honest one: the bound holds to a few %
        for k in ("1", "5"):
            assert mean[h][k]["share"] <= mean[h][k]["bound"] * 1.05, (h, k)
            assert mean[h][k]["share"] == pytest.approx(mean[h][k]["bound"], rel=0.05), (h, k)
            assert set(mean[h][k]["by_strategy"]) == {
                *influence_attacks.STRATEGIES,
                influence_attacks.MAJORITY,
            } - ({"disjoint-split"} if k == "1" else set())
    # weights grow with history: so does the share
    shares = [mean[h]["5"]["share"] for h in ("0", "1", "2", "4", "8")]
    assert shares == sorted(shares)


def test_equal_weights_reproduce_the_unweighted_numbers(weighted):
    honest = _honest(4)
    plan = influence.InfluencePlan(replicas=4, rounds=1, batch_size=1)
    unweighted = influence.measure_round(honest, SHAPES, plan)
    for rule in AGGREGATION_RULES:  # h = 8 = F: every weight equal
        for strategy, share in weighted["rules"][rule]["8"]["1"]["by_strategy"].items():
            if strategy != influence_attacks.MAJORITY:
                assert share == pytest.approx(unweighted[rule]["by_strategy"][strategy][1]["share"], rel=1e-5)
        effect = weighted["majority"]["rules"][rule]
        assert effect["8"] == pytest.approx(effect["headcount"], rel=1e-5)
    assert weighted["majority"]["norm_kept"]["8"] == pytest.approx(
        weighted["majority"]["norm_kept"]["headcount"]
    )


def test_a_tiny_majority_clips_honest_work_by_headcount_not_by_weight(weighted):
    codec = SparseLoCoCodec()
    honest = _honest(4)
    crowd = influence_attacks.majority_attack(honest, SHAPES, codec, 5, seed=0)
    for name, shape in SHAPES.items():  # valid payloads, each its own support, tiny
        supports = [set(tensors[name][0].tolist()) for _, tensors in crowd]
        assert all(len(s) == codec.grid(shape).total_selected for s in supports)
        assert all(len(supports[0] & s) < len(supports[0]) for s in supports[1:])
        largest = max(float(tensors[name][1].norm()) for _, tensors in crowd)
        assert largest < 0.05 * min(float(tensors[name][1].norm()) for _, tensors in honest)
    majority = weighted["majority"]
    assert majority["sybils"] == 5
    # by headcount the median norm is a Sybil's: the honest contributions are scaled down ~100x
    assert majority["norm_kept"]["headcount"] < 0.05
    # with weights (fresh Sybils at 1, 2 against honest at 8) the median is the one of the honest alone
    assert majority["norm_kept"]["1"] == majority["norm_kept"]["2"] == 1.0
    for rule, effect in majority["rules"].items():
        assert effect["headcount"]["delta_kept"] < 0.05, rule
        assert effect["1"]["delta_kept"] > 0.8 and effect["1"]["honest_share"] > 0.99, rule
        assert effect["0"] == {"honest_share": 1.0, "delta_kept": 1.0}
    # under "mean" the Sybils' weight still dilutes Δ: R·F / (R·F + k·w) of it is left
    assert majority["rules"]["mean"]["1"]["delta_kept"] == pytest.approx(32 / 37, rel=0.01)
    assert majority["rules"]["mean"]["headcount"]["honest_share"] < 0.6


def test_plans():
    assert influence.plan_for(True).replicas == 4 and influence.plan_for(False).max_sybils == 4
    with pytest.raises(ConfigError):
        influence.plan_for(True, replicas=1)
    plan = sparseloco_plan(True, None, (), ("selectors", "mean"), replicas=4)
    assert [m.name for m in plan.methods] == ["sparseloco-k64-H30-selectors", "sparseloco-k64-H30-mean"]
    assert plan.replicas == 4 and [m.aggregation for m in plan.methods] == ["selectors", "mean"]
    plan = sparseloco_plan(True, None, ("diloco-H30", "sparseloco-k64-H30-trimmed"))
    assert [m.name for m in plan.methods] == ["diloco-H30", "sparseloco-k64-H30-trimmed"]
    assert len(sparseloco_plan(True).methods) == 7
    with pytest.raises(ConfigError, match="unknown"):
        sparseloco_plan(True, None, (), ("median",))


@pytest.mark.slow
def test_influence_bench_end_to_end(tiny_config: Config, tmp_path: Path):
    plan = influence.InfluencePlan(replicas=4, rounds=1, batch_size=2, inner_steps=2, histories=(0, 1))
    report = influence.run_influence(tiny_config, plan, tmp_path, progress=False)
    saved = json.loads((tmp_path / "influence.json").read_text())
    assert saved["rules"].keys() == set(AGGREGATION_RULES) and saved["max_sybils"] == 2
    assert (tmp_path / "influence.png").stat().st_size > 1000
    weighted = saved["weighted"]
    assert weighted["full_weight"] == tiny_config.outer.probation_rounds
    assert weighted["sybils"] == [1, 5] and weighted["histories"] == [0, 1]
    assert weighted["rules"]["mean"]["0"]["5"]["share"] == 0.0
    assert weighted["rules"]["mean"]["1"]["5"]["share"] <= weighted["rules"]["mean"]["1"]["5"]["bound"] * 1.2
    assert weighted["majority"]["norm_kept"]["1"] == 1.0
    assert (tmp_path / "influence-weighted.png").stat().st_size > 1000
    assert (
        report["rules"]["selectors"]["one_identity"]["max_push"]
        > report["rules"]["mean"]["one_identity"]["max_push"]
    )
