"""The soak's verdicts from hand-written records: digests, half-applied rounds, the ledger against the
history, catch-up, re-forming, slopes; and its plan's refusals and schedule."""

from __future__ import annotations

import pytest

from hetnode.errors import HetnodeError
from hetnode.lab.runs import soak, soak_checks


def sealed(round_: int, time: float, contributors: list[str], rejected: dict, digests: dict) -> dict:
    return {"round": round_, "time": time, "contributors": contributors, "rejected": rejected,
            "layer_digests": digests}  # fmt: skip


HISTORY = [
    sealed(1, 100.0, ["a", "b"], {}, {"l0": "x1", "l1": "y1"}),
    sealed(2, 110.0, ["a", "b", "c"], {"c": "norm"}, {"l0": "x2", "l1": "y2"}),
    sealed(3, 125.0, ["a"], {}, {"l0": "x3", "l1": "y3"}),
]


def peer(name: str, round_: int, digests: dict[str, str], role: str = "anchor") -> dict:
    return {"name": name, "role": role, "params_round": round_, "layer_digests": digests}


def test_digests_agree_disagree_or_show_a_half_applied_round():
    checks = soak_checks.check_digests(
        [
            peer("same", 2, {"l0": "x2", "l1": "y2"}),
            peer("stage", 3, {"l1": "y3"}, role="stage"),  # a stage holds some layers
            peer("half", 3, {"l0": "x3", "l1": "y2"}),  # l1 still round 2's
            peer("off", 2, {"l0": "x2", "l1": "garbage"}),
            peer("future", 9, {"l0": "x9"}),
            peer("coordinator", 3, {}, role="coordinator"),  # not a replica: not checked
        ],
        HISTORY,
    )
    assert {c.replica: c.verdict for c in checks} == {
        "same": "agrees",
        "stage": "agrees",
        "half": "half-applied",
        "off": "disagrees",
        "future": "unknown-round",
    }


def test_the_ledger_must_credit_exactly_the_sealed_contributors_less_refused_ones():
    credited = {1: {"a", "b"}, 2: {"a", "b"}, 3: {"a"}}
    assert soak_checks.ledger_mismatches(HISTORY, credited) == []
    wrong = {1: {"a"}, 2: {"a", "b", "c"}, 3: {"a"}, 4: {"z"}}
    assert soak_checks.ledger_mismatches(HISTORY, wrong) == [
        {"round": 1, "missing": ["b"], "extra": []},
        {"round": 2, "missing": [], "extra": ["c"]},
        {"round": 4, "missing": [], "extra": ["z"], "unsealed": True},
    ]


def test_slopes_and_growth_per_hour():
    flat = [(t * 60.0, 100.0) for t in range(10)]
    assert soak_checks.slope_per_hour(flat) == 0.0
    rising = [(t * 60.0, 100.0 + t) for t in range(10)]  # 1 MB a minute
    assert soak_checks.slope_per_hour(rising) == pytest.approx(60.0)
    assert soak_checks.growth_per_hour(rising) == pytest.approx(60.0 / 104.5)
    assert soak_checks.slope_per_hour(rising[:2]) is None
    spiky = [(t * 60.0, 40.0 + (14.0 if t in (3, 11) else 0.0)) for t in range(20)]  # two streams open
    assert soak_checks.slope_per_hour(spiky) == 0.0
    assert soak_checks.slope_per_hour([*spiky[:-1], (19 * 60.0, 47.0)]) == 0.0  # a spike at the end


def test_catch_up_counts_rounds_to_the_swarms_theta_and_to_the_first_included_round():
    records = [
        {"round": 4, "time": 50.0, "included": True},
        {"round": 5, "time": 201.0, "included": False},  # trained before it left, sealed after: stale
        {"round": 9, "time": 205.0, "included": False},  # trained on θ after 8: caught up, announced late
        {"round": 10, "time": 215.0, "included": True},
    ]
    assert soak_checks.catch_up_rounds(records, back_at=200.0, sealed_then=6) == 2  # θ after 8, 2 past 6
    assert soak_checks.contributing_rounds(records, back_at=200.0, sealed_then=6) == 4
    assert soak_checks.catch_up_rounds(records, back_at=300.0, sealed_then=9) is None
    assert soak_checks.contributing_rounds(records, back_at=300.0, sealed_then=9) is None


def test_reforming_is_counted_in_boundaries_from_the_death():
    assert soak_checks.boundaries_to_reform(100.0, [90.0, 106.0, 120.0], boundary_s=4.0) == 1.5
    assert soak_checks.boundaries_to_reform(100.0, [90.0], boundary_s=4.0) is None


def test_round_times_and_quantiles():
    assert soak_checks.round_times(HISTORY) == [10.0, 15.0]
    q = soak_checks.quantiles([float(v) for v in range(1, 11)])
    assert q == {"p10": 2.0, "p50": 6.0, "p90": 10.0, "max": 10.0, "n": 10}
    assert soak_checks.quantiles([]) is None


def test_the_plan_is_refused_when_it_cannot_show_the_churn():
    soak.validate(soak.SoakPlan(minutes=10))
    with pytest.raises(HetnodeError, match="--anchors 3"):
        soak.validate(soak.SoakPlan(anchors=2))
    with pytest.raises(HetnodeError, match="spare"):
        soak.validate(soak.SoakPlan(stage_peers=2))
    with pytest.raises(HetnodeError, match="too short"):
        soak.validate(soak.SoakPlan(minutes=3))


def test_the_schedule_has_every_kind_of_churn_in_order():
    events = soak.churn_schedule(soak.SoakPlan())
    kinds = {e.kind for e in events}
    assert {"join", "leave", "crash", "link-down", "chain-member-dies", "coordinator-restart"} <= kinds
    shares = [e.at_share for e in events]
    assert shares == sorted(shares) and shares[-1] < 0.9  # the last tenth is quiet: the swarm settles


def test_chain_live_times_come_from_the_stage_log(tmp_path):
    import datetime

    log = tmp_path / "stage-1.log"
    log.write_text(
        "19:22:01 hetnode INFO hetnode.daemon.peer: link up 20.0 / down 20.0 Mbit/s\n"
        "19:22:08 hetnode INFO hetnode.daemon.peer: chain c6-e954dba3a2 live: stage 1, layers 2..3\n"
        "23:59:59 hetnode INFO hetnode.daemon.peer: chain c9-00 live: stage 0, layers 0..1\n"
    )
    now = datetime.datetime(2026, 12, 1, 19, 30, 0).timestamp()
    times = soak.live_times(log, now=now)
    assert times == [
        datetime.datetime(2026, 12, 1, 19, 22, 8).timestamp(),
        datetime.datetime(2026, 11, 30, 23, 59, 59).timestamp(),  # later than now: yesterday's
    ]


def test_a_slope_is_judged_on_the_longest_stretch_in_one_role_after_its_warm_up():
    rss = [(float(t), 400.0 if t < 600 else 550.0) for t in range(0, 3000, 60)]  # a step at a role change
    fds = [(t, 40.0) for t, _ in rss]
    kept_rss, kept_fds = soak_checks.steady_stretch(rss, fds, [600.0], warmup_s=180.0, min_span_s=600.0)
    assert kept_rss[0][0] == 780.0 and kept_rss[-1][0] == 2940.0  # after the change, less its warm-up
    assert soak_checks.growth_per_hour(kept_rss) == 0.0 and len(kept_fds) == len(kept_rss)
    short = soak_checks.steady_stretch(rss[:20], fds[:20], [600.0], warmup_s=180.0, min_span_s=600.0)
    assert short == ([], [])  # 420 s after the warm-up: too short to judge
    leaking = [(t, 500.0 + t / 100) for t, _ in rss]
    kept, _ = soak_checks.steady_stretch(leaking, fds, [], warmup_s=180.0, min_span_s=600.0)
    assert soak_checks.growth_per_hour(kept) > 0.05  # a real leak still shows


def test_wan_links_are_given_per_host_and_a_host_the_lab_lacks_is_refused():
    plan = soak.SoakPlan(wan=(("anchor-4", "far-fast"), ("stage-3", "dsl")))
    assert plan.profile("anchor-4").rtt_ms == 150.0 and plan.profile("stage-3").up_mbit == 5.0
    assert not plan.profile("anchor-1").emulated and plan.profile("anchor-1").up_mbit == plan.anchor_mbit
    assert plan.profile("stage-1").down_mbit == plan.stage_mbit
    soak.validate(plan)
    with pytest.raises(HetnodeError, match="no lab host"):
        soak.validate(soak.SoakPlan(wan=(("anchor-9", "far"),)))
