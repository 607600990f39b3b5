"""Roles and chain packing: same inputs in any order give the same plan; confirmation catches disagreement."""

import random

import pytest

from hetnode.planning.roles import (
    Candidate,
    Claim,
    ClassThresholds,
    anchor_memory_gb,
    assignment_for,
    chain_status,
    classify_link,
    next_role,
    pack_chains,
    wanted_role,
)

THRESHOLDS = ClassThresholds(anchor_min_up_mbps=500, anchor_min_down_mbps=500, stage_min_up_mbps=5)
TINY_PARAMS = 890_000


@pytest.mark.parametrize(
    ("up", "down", "mem_gb", "params", "expected"),
    [
        (1000, 1000, 16, TINY_PARAMS, "high"),
        (500, 500, 16, TINY_PARAMS, "high"),  # thresholds are inclusive
        (499, 1000, 16, TINY_PARAMS, "low"),  # upload limits
        (1000, 20, 16, TINY_PARAMS, "low"),  # download limits
        (1000, 1000, 1, 1_000_000_000, "low"),  # fast but no memory for a full 1B replica
        (20, 20, 16, TINY_PARAMS, "low"),
        (4, 100, 16, TINY_PARAMS, "slow"),
        (100, 4, 16, TINY_PARAMS, "slow"),
    ],
)
def test_classify_link(up, down, mem_gb, params, expected):
    assert classify_link(up, down, mem_gb, params, THRESHOLDS) == expected


def test_anchor_memory_scales_with_parameters():
    assert anchor_memory_gb(1_000_000_000) == pytest.approx(36.0)
    assert anchor_memory_gb(TINY_PARAMS) < 0.1


@pytest.mark.parametrize(
    ("link", "request_", "expected"),
    [
        ("high", "auto", "anchor"),
        ("low", "auto", "stage"),
        ("high", "stage", "stage"),
        ("low", "anchor", "anchor"),
        ("slow", "anchor", "idle"),
        ("slow", "auto", "idle"),
    ],
)
def test_wanted_role(link, request_, expected):
    assert wanted_role(link, request_) == expected


@pytest.mark.parametrize(
    ("current", "live", "wanted", "expected"),
    [
        ("stage", True, "stage", "stage"),  # a live chain keeps its members
        ("stage", False, "stage", "idle"),  # a broken chain dissolves: back to the pool
        ("stage", True, "anchor", "anchor"),  # class went up: leave the chain
        ("anchor", False, "stage", "idle"),  # class went down: join the pool
        ("idle", False, "stage", "idle"),
        ("idle", False, "anchor", "anchor"),
        ("anchor", False, "idle", "idle"),  # slow link: no role
    ],
)
def test_next_role_switches_only_by_rule(current, live, wanted, expected):
    assert next_role(current, live, wanted) == expected


def _candidates(n, seed=0):
    rng = random.Random(seed)
    return [
        Candidate(peer_id=f"Qm{rng.getrandbits(64):016x}", tflops=round(rng.uniform(0.5, 4), 2))
        for _ in range(n)
    ]


@pytest.mark.parametrize(
    ("n", "stages", "chains"), [(0, 3, 0), (2, 3, 0), (3, 3, 1), (5, 3, 1), (6, 3, 2), (7, 2, 3)]
)
def test_pack_chains_same_plan_for_any_order(n, stages, chains):
    candidates = _candidates(n, seed=n)
    reference = pack_chains(candidates, stages, n_layers=12, boundary=7)
    assert len(reference) == chains
    for seed in range(5):
        shuffled = list(candidates)
        random.Random(seed).shuffle(shuffled)
        assert pack_chains(shuffled, stages, n_layers=12, boundary=7) == reference
    members = [m for plan in reference for m in plan.members]
    assert len(members) == len(set(members))  # nobody is in two chains


def test_pack_chains_covers_layers_and_follows_compute():
    candidates = [Candidate("a", 1.0), Candidate("b", 3.0), Candidate("c", 2.0)]
    [plan] = pack_chains(candidates, 3, n_layers=12, boundary=1)
    assert plan.members == ("b", "c", "a")  # fastest first
    assert [s.layers for s in plan.stages] == [(0, 5), (6, 9), (10, 11)]  # 3:2:1 compute -> 6:4:2 layers
    assert assignment_for([plan], "c").stage == 1
    assert assignment_for([plan], "zz") is None


def test_pack_chains_name_depends_on_boundary_and_members():
    candidates = _candidates(3)
    a = pack_chains(candidates, 3, 6, boundary=1)[0].chain
    assert pack_chains(candidates, 3, 6, boundary=2)[0].chain != a
    assert pack_chains(candidates[:2] + _candidates(1, seed=99), 3, 6, boundary=1)[0].chain != a


def _claims(plan):
    return [Claim(s.peer_id, s.chain, s.stage, s.layers, s.layout) for s in plan.stages]


def test_chain_status_live_when_every_member_confirms():
    [plan] = pack_chains(_candidates(3), 3, n_layers=4, boundary=5)
    claims = _claims(plan)
    random.Random(0).shuffle(claims)
    [status] = chain_status(claims, 3, 4)
    assert status.live and status.problem == ""
    assert status.stages == plan.members


@pytest.mark.parametrize("drop", [0, 1, 2])
def test_chain_status_not_live_with_a_member_missing(drop):
    [plan] = pack_chains(_candidates(3), 3, n_layers=4, boundary=5)
    claims = _claims(plan)
    del claims[drop]
    [status] = chain_status(claims, 3, 4)
    assert not status.live and f"stage {drop} has no member" in status.problem
    assert status.stages[drop] is None


def test_chain_status_rejects_inconsistent_claims():
    [plan] = pack_chains(_candidates(3), 3, n_layers=4, boundary=5)
    claims = _claims(plan)
    # a member that computed a different layer split (it saw other compute figures) does not count
    bad = Claim(claims[2].peer_id, plan.chain, 2, (claims[2].layers[0], 2), claims[2].layout)
    status = chain_status(claims[:2] + [bad], 3, 4)[0]
    assert not status.live and "stage 2 has no member" in status.problem
    # a stranger who copies the chain's name with a consistent-looking layout does not match the name
    swapped = [
        Claim("stranger" if c.stage == 0 else c.peer_id, c.chain, c.stage, c.layers, c.layout) for c in claims
    ]
    assert not chain_status(swapped, 3, 4)[0].live
    forged = tuple(("stranger", *m[1:]) if i == 0 else m for i, m in enumerate(claims[0].layout))
    alone = [Claim("stranger", plan.chain, 0, claims[0].layers, forged)]
    assert "name" in chain_status(alone, 3, 4)[0].problem
    # out-of-range stage
    assert "name" in chain_status([Claim("x", plan.chain, 7, (0, 3))], 3, 4)[0].problem


def test_a_strangers_claim_on_a_live_chain_changes_nothing():
    """Hide-the-swarm attack: an identity claims a live chain's name and stage (with or without copying its
    layout); the chain stays live with its own members."""
    [plan] = pack_chains(_candidates(3), 3, n_layers=4, boundary=5)
    claims = _claims(plan)
    layout = claims[1].layout
    intruders = [
        Claim("intruder", plan.chain, 1, claims[1].layers, layout),
        Claim("intruder-2", plan.chain, 1, claims[1].layers),
        Claim("intruder-3", plan.chain, 0, (0, 3), (("intruder-3", 0, 3),)),
    ]
    [status] = chain_status(claims + intruders, 3, 4)
    assert status.live and status.stages == plan.members
