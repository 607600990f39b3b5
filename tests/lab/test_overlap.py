"""The overlap measurement (issue 34): honest pairs, own previous rounds and perturbed copies, on real
payloads; a perturbed copy keeps the wire format (exactly k per tile) and overlaps its original by ~1 - f."""

import json
from pathlib import Path

import pytest
import torch

from hetnode.algo.scoring import index_overlap
from hetnode.algo.sparseloco import SparseLoCoCodec
from hetnode.config import Config
from hetnode.errors import ConfigError
from hetnode.lab.experiments import overlap, overlap_report

SHAPES = {"w": (128, 192), "b": (128,)}


def _payload(seed: int) -> dict:
    gen = torch.Generator().manual_seed(seed)
    codec = SparseLoCoCodec()
    return {n: codec.sparse(codec.compress(torch.randn(s, generator=gen))) for n, s in SHAPES.items()}


def test_perturbed_copy_is_a_valid_payload_that_overlaps_by_one_minus_f():
    codec = SparseLoCoCodec()
    original = _payload(1)
    gen = torch.Generator().manual_seed(0)
    last = 1.0
    for f in (0.0, 0.05, 0.5, 1.0):
        copy = overlap.perturb(original, SHAPES, codec, f, gen)
        for name, (idx, vals) in copy.items():
            grid = codec.grid(SHAPES[name])
            assert idx.numel() == grid.total_selected and torch.unique(idx).numel() == idx.numel()
            # still exactly k per tile
            mask = torch.zeros(grid.numel)
            mask[idx] = 1
            assert torch.equal(
                grid.to_tiles(mask.reshape(grid.shape)).sum(1), torch.full((grid.num_tiles,), grid.k)
            )
            assert torch.equal(vals.sort().values, original[name][1].sort().values)  # values kept
        ov = index_overlap(copy, original)
        assert ov == pytest.approx(1 - f, abs=0.01) and ov <= last
        assert overlap.cosine(copy, original, SHAPES) == pytest.approx(1 - f, abs=0.05)
        last = ov
    assert overlap.cosine(original, original, SHAPES) == pytest.approx(1.0)
    # independent random payloads share ~k / tile_elems of their positions
    assert index_overlap(_payload(1), _payload(2)) < 0.05


def test_plans_and_suggestion():
    assert overlap.plan_for(True).replica_counts == (2, 4, 8)
    assert overlap.plan_for(False).replica_counts == (2, 4, 8, 16) and overlap.plan_for(False).rounds == 5
    assert overlap.plan_for(True, (3,), 2, 4, 5).inner_steps == 5
    with pytest.raises(ConfigError):
        overlap.plan_for(True, (1, 4))
    with pytest.raises(ConfigError):
        overlap.plan_for(True, rounds=0)
    assert overlap_report.ceil_step(0.2591 + 0.05) == 0.35 and overlap_report.ceil_step(0.25 + 0.05) == 0.3


def test_overlap_bench_end_to_end(tiny_config: Config, tmp_path: Path):
    plan = overlap.OverlapPlan(replica_counts=(2, 3), rounds=2, batch_size=2, inner_steps=2)
    report = overlap.run_overlap(tiny_config, plan, tmp_path, progress=False)
    saved = json.loads((tmp_path / "overlap.json").read_text())
    assert saved["by_replicas"].keys() == {"2", "3"} and saved["machine"]["cpus"]
    assert (tmp_path / "overlap.png").stat().st_size > 1000
    for replicas, result in report["by_replicas"].items():
        first, second = result["rounds"]
        assert first["pairs"]["overlap"]["n"] == int(replicas) * (int(replicas) - 1) // 2
        assert first["own_previous"]["overlap"] is None
        assert second["own_previous"]["overlap"]["n"] == int(replicas)
        for r in result["rounds"]:
            for stats in (r["pairs"]["overlap"], r["own_previous"]["overlap"] or r["pairs"]["overlap"]):
                assert 0.0 <= stats["min"] <= stats["median"] <= stats["max"] <= 1.0
            assert -1.0 <= r["pairs"]["cosine"]["min"] <= r["pairs"]["cosine"]["max"] <= 1.0
            # honest replicas from the same θ correlate, but far from a copy
            assert r["random_overlap"] < r["pairs"]["overlap"]["max"] < 0.9
            pert = r["perturbed"]
            assert pert["0.05"]["overlap"] == pytest.approx(0.95, abs=0.01)
            assert pert["0.05"]["overlap"] > pert["0.5"]["overlap"] > pert["0.75"]["overlap"]
            assert pert["0.05"]["cosine"] > pert["0.5"]["cosine"]
    s = report["suggestion"]
    assert s["honest_pair_overlap_max"] + s["margin"] <= s["index_overlap_threshold"] <= 1.0
    lowest = {
        f: min(
            r["perturbed"][str(f)]["overlap"] for res in report["by_replicas"].values() for r in res["rounds"]
        )
        for f in plan.fractions
    }
    assert s["caught_fractions"] == [f for f in plan.fractions if lowest[f] >= s["index_overlap_threshold"]]
    assert 0.05 in s["caught_fractions"] and s["caught_fractions_at_current_threshold"] == [0.05]
    assert s["relative_threshold_over_round_median"] >= s["honest_pair_spread_max"] + s["margin"]
    assert 0.05 in s["caught_fractions_by_relative_rule"]
