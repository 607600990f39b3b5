"""`hetnode bench trust` end to end on a tiny plan: it writes the JSON and PNG it promises, and its
measures mean what they say."""

import json
from pathlib import Path

import pytest

from hetnode.config import Config
from hetnode.lab.experiments import trust_bench

pytestmark = pytest.mark.slow


def test_trust_bench_runs_and_reports_each_mode(tiny_config: Config, tmp_path: Path):
    plan = trust_bench.TrustPlan(honest=3, rounds=3, inner_steps=2, modes=("signflip", "copy"), batch_size=2)
    report = trust_bench.run_benchmark(tiny_config, plan, tmp_path, progress=False)
    saved = json.loads((tmp_path / "trust.json").read_text())
    assert saved["modes"].keys() == {"signflip", "copy"} and (tmp_path / "trust.png").stat().st_size > 1000
    copy = report["modes"]["copy"]
    assert copy["rounds_to_exclusion"] == 1 and copy["reasons"] == ["copy"]  # refused from its first round
    assert copy["rounds_with_weight"] == 0 and copy["rounds_to_no_credit"] == 1
    assert report["score_lag"] == 1  # scores reach the screens a sealed round late, as the worker's do
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
    assert trust_bench.rounds_with_weight(run) == 2
    assert trust_bench.rounds_to_exclusion(trust_bench.RunResult([], [{}, {}], [], [])) is None
    assert trust_bench.false_exclusions(trust_bench.RunResult([], [{"peer-h1": "norm"}], [], [])) == 1


def test_credit_refused_after_a_late_score_counts_apart_from_weight():
    """Sealed in rounds 1-3, its credit refused from round 2 (its score came late), out of the seal from 4."""
    weight = [{}, {}, {}, {"peer-xx": "score"}, {"peer-xx": "score"}]
    credit = [{}, {"peer-xx": "score"}, {"peer-xx": "score"}, {}, {}]
    run = trust_bench.RunResult([], weight, [], [], credit)
    assert trust_bench.rounds_to_exclusion(run) == 4 and trust_bench.rounds_with_weight(run) == 3
    assert trust_bench.rounds_to_no_credit(run) == 2
    honest = trust_bench.RunResult([], [{}, {}], [], [], [{"peer-h0": "score"}, {}])
    assert trust_bench.false_exclusions(honest) == 1  # credit refused to honest work counts too


def test_the_score_lag_is_checked():
    with pytest.raises(ValueError, match="score-lag"):
        trust_bench.plan_for(True, score_lag=-1)
    assert (
        trust_bench.plan_for(True).score_lag == 1 and trust_bench.plan_for(True, score_lag=0).score_lag == 0
    )


def test_trust_bench_at_mixed_speeds_runs_paced_and_counts_each_honest_replicas_steps(
    tiny_config: Config, tmp_path: Path
):
    plan = trust_bench.plan_for(True, rounds=3, modes=("signflip",), inner_steps=4, speeds=(0.25, 1.0, 2.0))
    plan = trust_bench.TrustPlan(**{**plan.__dict__, "honest": 3, "batch_size": 2})
    report = trust_bench.run_benchmark(tiny_config, plan, tmp_path, progress=False)
    assert report["steps"] == {"peer-h0": 1, "peer-h1": 4, "peer-h2": 8, trust_bench.ATTACKER: 4}
    # the seal counted an honest contribution's steps as the sealer does: at most what it trained
    counted = report["honest_steps_counted_clean"]
    assert counted is not None and 0 < counted <= 1
    assert report["modes"]["signflip"]["honest_steps_counted"] is not None


def test_speeds_are_shares_of_h_up_to_the_cap():
    with pytest.raises(ValueError, match="speeds"):
        trust_bench.plan_for(True, speeds=(0.5, 3.0))
    with pytest.raises(ValueError, match="speeds"):
        trust_bench.plan_for(True, speeds=(0.0,))
