"""`hetnode bench chain-score` (and its `--rounds`) end to end on a tiny plan: it writes the JSON and PNG it
promises, scores each chain beside the three anchors with the verifier's own `score`, and a chain that does
an anchor's math (no compression, AdamW: one model split in two) is scored as one."""

import json
import math
from pathlib import Path

import pytest

from hetnode.config import Config
from hetnode.lab.experiments import chain_rounds_bench, chain_score_bench

pytestmark = pytest.mark.slow


def test_each_chain_is_scored_beside_three_anchors_and_an_unconstrained_one_helps(
    tiny_config: Config, tmp_path: Path
):
    plan = chain_score_bench.ChainScorePlan(
        inner_steps=3, warm_steps=(8,), modes=("selective", "none"), optimizers=("adamw",), batch_size=4
    )
    report = chain_score_bench.run_benchmark(tiny_config, plan, tmp_path, progress=False)
    saved = json.loads((tmp_path / "chain_score.json").read_text())
    assert saved["summary"].keys() == {"selective/adamw", "none/adamw"}
    assert (tmp_path / "chain_score.png").stat().st_size > 1000
    for mode in ("selective", "none"):
        rows = [r for r in report["rows"] if r["mode"] == mode]
        assert sorted(r["role"] for r in rows) == ["anchor"] * 3 + ["stage"] * 2, rows
        anchors = sorted(r["score"] for r in rows if r["role"] == "anchor")
        assert anchors[1] == pytest.approx(1 - report["margin"], abs=0.5)  # the yardstick is theirs
    plain = [r for r in report["rows"] if r["mode"] == "none" and r["role"] == "stage"]
    assert all(r["score"] > 0 and r["share_of_anchors"] > 0.5 for r in plain), plain


def test_chain_rounds_seal_the_chain_by_its_score_always_or_never_and_restore_what_was_left_out(
    tiny_config: Config, tmp_path: Path
):
    """`--rounds`: the verifier's score decides the screened run's seals, the chain is in every seal of
    the `always` run, and without a chain θ follows another path."""
    plan = chain_rounds_bench.ChainRoundsPlan(rounds=3, inner_steps=3, modes=("selective",), batch_size=4)
    report = chain_rounds_bench.run_benchmark(tiny_config, plan, tmp_path, progress=False)
    saved = json.loads((tmp_path / "chain_rounds.json").read_text())
    assert set(saved["runs"]) == {"selective/screened", "selective/always", "selective/anchors"}
    assert (tmp_path / "chain_rounds.png").stat().st_size > 1000
    screened, always, alone = (report["runs"][f"selective/{r}"] for r in ("screened", "always", "anchors"))
    for run in (screened, always, alone):
        assert len(run["eval_loss"]) == 3 and all(math.isfinite(x) for x in run["eval_loss"])
    for scores, sealed in zip(screened["stage_scores"], screened["sealed"], strict=True):
        assert sealed == [s >= 0 for s in scores], (scores, sealed)
    assert all(all(row) for row in always["sealed"])
    assert (
        alone["stage_scores"] == [[], [], []]
        and report["summary"]["selective/anchors"]["chain_sealed_share"] is None
    )
    assert always["eval_loss"][-1] != alone["eval_loss"][-1]  # the chain's work reached θ
    assert all(0 < share < 10 for row in always["feedback"] for share in row)  # a residual, bounded
