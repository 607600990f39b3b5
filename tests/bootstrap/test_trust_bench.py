"""`hetnode bench trust` end to end on a tiny plan: it writes the JSON and PNG it promises, and its
measures mean what they say."""

import json
from pathlib import Path

import pytest

from bootstrap import trust_bench
from hetnode.config import Config

pytestmark = pytest.mark.slow


def test_trust_bench_runs_and_reports_each_mode(tiny_config: Config, tmp_path: Path):
    plan = trust_bench.TrustPlan(honest=3, rounds=3, inner_steps=2, modes=("signflip", "copy"), batch_size=2)
    report = trust_bench.run_benchmark(tiny_config, plan, tmp_path, progress=False)
    saved = json.loads((tmp_path / "trust.json").read_text())
    assert saved["modes"].keys() == {"signflip", "copy"} and (tmp_path / "trust.png").stat().st_size > 1000
    copy = report["modes"]["copy"]
    assert copy["rounds_to_exclusion"] == 1 and copy["reasons"] == ["copy"]  # refused from its first round
    for mode in report["modes"].values():  # (false exclusions are measured by the bench, at its own scale)
        # verify_share is scoring time over training time: at 2 steps of 2 sequences scoring costs more than
        # training (it is measured against the target at the bench's scale, not here)
        assert isinstance(mode["false_exclusions"], int) and mode["verify_share"] > 0
        for key in ("final_eval_loss", "final_eval_loss_clean", "final_eval_loss_unverified"):
            assert mode[key] > 0
    assert len(report["curves"]["clean"]) == 3


def test_rounds_to_exclusion_counts_until_the_attacker_stays_out():
    run = trust_bench.RunResult([], [{}, {"peer-xx": "score"}, {}, {"peer-xx": "score"}], [], [])
    assert trust_bench.rounds_to_exclusion(run) == 4
    assert trust_bench.rounds_to_exclusion(trust_bench.RunResult([], [{}, {}], [], [])) is None
    assert trust_bench.false_exclusions(trust_bench.RunResult([], [{"peer-h1": "norm"}], [], [])) == 1
