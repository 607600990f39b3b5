"""Roles and chain packing: same inputs in any order give the same plan; confirmation catches disagreement."""

import dataclasses
import random

import pytest

from hetnode.planning.roles import (
    Candidate,
    Claim,
    ClassThresholds,
    anchor_memory_gb,
    assignment_for,
    chain_id,
    chain_status,
    classify_link,
    grown_successor,
    lineage_of,
    next_role,
    pack_chains,
    plan_boundary,
    plan_successors,
    stage_of,
    stage_pools,
    stepped_in_successor,
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


# --- successors: a chain outlives its members ---------------------------------------------------------


def _successor_claims(plan, broken=()):
    return [
        Claim(s.peer_id, s.chain, s.stage, s.layers, s.layout, plan.lineage, s.peer_id in broken)
        for s in plan.stages
    ]


def _formed_chain(stages=3, n_layers=6, boundary=5):
    [plan] = pack_chains(_candidates(stages), stages, n_layers=n_layers, boundary=boundary)
    return plan


def _broken(claims):
    """The claims of members whose training in the chain ended (their records say so)."""
    return [Claim(c.peer_id, c.chain, c.stage, c.layers, c.layout, c.lineage, True) for c in claims]


def test_a_spare_takes_the_empty_stage_and_the_chain_keeps_its_lineage():
    plan = _formed_chain()
    gone = plan.members[1]
    claims = _broken(c for c in _claims(plan) if c.peer_id != gone)
    spares = [Candidate("spare-slow", 0.5), Candidate("spare-fast", 5.0)]
    [status] = chain_status(claims, 3, 6)
    assert not status.live and status.lineage == plan.chain
    successors, left = plan_successors([status], spares, 3, 6, boundary=6)
    [successor] = successors
    assert [c.peer_id for c in left] == ["spare-slow"]  # the fastest spare stepped in
    assert successor.members == (plan.members[0], "spare-fast", plan.members[2])
    assert successor.survivors == tuple(sorted(set(plan.members) - {gone}))
    assert successor.newcomers == ("spare-fast",)
    # the member that left may hand the newcomer its stage's error feedback; nobody else is asked
    assert successor.predecessors == (("spare-fast", (gone,)),)
    assert (
        successor.predecessors_of("spare-fast") == (gone,) and successor.predecessors_of("spare-slow") == ()
    )
    # every stage keeps its layers (the survivors' local state stays valid), the lineage is the founder's
    assert [s.layers for s in successor.stages] == [s.layers for s in plan.stages]
    assert successor.lineage == plan.chain and successor.chain != plan.chain
    assert successor.chain.startswith("c6-")
    # once every member claims it, the successor is live and says its lineage
    [live] = chain_status(_successor_claims(successor), 3, 6)
    assert live.live and live.lineage == plan.chain and live.stages == successor.members
    # its own successor keeps the founder's lineage
    again = _broken(c for c in _successor_claims(successor) if c.peer_id != "spare-fast")
    [third], _ = plan_successors(chain_status(again, 3, 6), spares, 3, 6, boundary=7)
    assert third.lineage == plan.chain and third.members[1] == "spare-fast"


def test_successor_plans_agree_whatever_the_order():
    plans = [pack_chains(_candidates(2, seed=seed), 2, n_layers=4, boundary=3)[0] for seed in (1, 2, 3)]
    claims = _broken(c for plan in plans for c in _claims(plan)[1:])  # every chain lost its first stage
    spares = _candidates(5, seed=9)
    reference = plan_boundary(chain_status(claims, 2, 4), spares, 2, 4, boundary=4)
    assert sum(1 for p in reference if p.lineage) == 3  # three successors, one new chain of the rest
    assert len(reference) == 4
    for seed in range(5):
        rng = random.Random(seed)
        shuffled_claims, shuffled_spares = claims[:], spares[:]
        rng.shuffle(shuffled_claims)
        rng.shuffle(shuffled_spares)
        statuses = chain_status(shuffled_claims, 2, 4)
        rng.shuffle(statuses)
        assert plan_boundary(statuses, shuffled_spares, 2, 4, boundary=4) == reference


def test_without_enough_spares_the_chain_is_not_continued():
    plan = _formed_chain()
    claims = _broken(_claims(plan)[:1])  # two stages empty
    successors, left = plan_successors(chain_status(claims, 3, 6), [Candidate("only", 1.0)], 3, 6, 6)
    assert successors == [] and [c.peer_id for c in left] == ["only"]


def test_the_members_that_say_the_chain_broke_survive_and_a_silent_one_is_replaced():
    plan = _formed_chain(stages=2, n_layers=4)
    first, second = plan.members
    # both alive, one says its training broke: the other, whose record is stale or who noticed late, is out
    claims = [
        Claim(s.peer_id, s.chain, s.stage, s.layers, s.layout, "", s.peer_id == first) for s in plan.stages
    ]
    [status] = chain_status(claims, 2, 4)
    assert not status.live and "broken" in status.problem and status.broken == (first,)
    [successor], _ = plan_successors([status], [Candidate("spare", 1.0)], 2, 4, boundary=6)
    assert successor.members == (first, "spare")
    # both say so: the chain re-forms in place, no spare needed, under a new name of the same lineage
    claims = [Claim(s.peer_id, s.chain, s.stage, s.layers, s.layout, "", True) for s in plan.stages]
    [in_place], left = plan_successors(chain_status(claims, 2, 4), [Candidate("spare", 1.0)], 2, 4, 6)
    assert in_place.members == plan.members and in_place.newcomers == () and len(left) == 1
    assert in_place.chain != plan.chain and in_place.lineage == plan.chain


def test_a_lineage_with_a_live_chain_is_not_continued_again():
    plan = _formed_chain(stages=2, n_layers=4)
    first, second = plan.members
    [successor], _ = plan_successors(
        chain_status(_broken(_claims(plan)[:1]), 2, 4), [Candidate("spare", 1.0)], 2, 4, boundary=6
    )
    # the successor runs; the member left behind still claims the old chain, broken, alone
    left_behind = Claim(second, plan.chain, 1, plan.stages[1].layers, plan.stages[1].layout, "", True)
    statuses = chain_status(_successor_claims(successor) + [left_behind], 2, 4)
    successors, _ = plan_successors(statuses, [Candidate("other", 1.0)], 2, 4, boundary=7)
    assert successors == []  # no second chain on the same lineage: the straggler goes back to the pool


def test_a_chain_formed_at_this_boundary_is_not_continued_yet():
    plan = _formed_chain(boundary=6)
    claims = _broken(_claims(plan)[:2])
    assert plan_successors(chain_status(claims, 3, 6), [Candidate("s", 1.0)], 3, 6, boundary=6)[0] == []


def test_a_lineage_must_be_an_older_chain():
    """A successor's name commits to its lineage: a claim cannot move it, nor name a chain not yet founded."""
    plan = _formed_chain(stages=2, n_layers=4)
    [successor], _ = plan_successors(
        chain_status(_broken(_claims(plan)[:1]), 2, 4), [Candidate("spare", 1.0)], 2, 4, boundary=6
    )
    claims = _successor_claims(successor)
    assert chain_status(claims, 2, 4)[0].live
    moved = [Claim(c.peer_id, c.chain, c.stage, c.layers, c.layout, "c1-0123456789") for c in claims]
    assert "name" in chain_status(moved, 2, 4)[0].problem
    layout = ((plan.members[0], 0, 1), ("spare", 2, 3))
    future = chain_id(6, [(p, (f, last)) for p, f, last in layout], "c9-0123456789")
    forged = [
        Claim(p, future, i, (f, last), layout, "c9-0123456789") for i, (p, f, last) in enumerate(layout)
    ]
    assert not chain_status(forged, 2, 4)[0].live
    assert lineage_of(plan.chain) == plan.chain and lineage_of(successor.chain, plan.chain) == plan.chain


def test_a_lineage_is_continued_once_from_the_chain_whose_members_say_it_broke():
    plan = _formed_chain(stages=2, n_layers=4)
    first, second = plan.members
    # a successor that was never confirmed: its newcomer died with its claim still in the records
    [failed], _ = plan_successors(
        chain_status(_broken(_claims(plan)[:1]), 2, 4), [Candidate("gone", 9.0)], 2, 4, 6
    )
    stale = [c for c in _successor_claims(failed) if c.peer_id == "gone"]
    survivor = Claim(first, plan.chain, 0, plan.stages[0].layers, plan.stages[0].layout, "", True)
    statuses = chain_status(stale + [survivor], 2, 4)
    successors, _ = plan_successors(statuses, [Candidate("spare", 1.0)], 2, 4, boundary=7)
    [successor] = successors
    assert successor.survivors == (first,) and successor.members == (first, "spare")
    assert successor.lineage == plan.chain


def _strangers_chain(lineage, strangers, layers, boundary, broken=()):
    """Claims of a chain of `strangers` only, naming someone else's lineage (a bare claim anyone can make)."""
    layout = tuple((peer, first, last) for peer, (first, last) in zip(strangers, layers, strict=True))
    name = chain_id(boundary, [(p, (f, last)) for p, f, last in layout], lineage)
    return [
        Claim(p, name, i, (f, last), layout, lineage, p in broken) for i, (p, f, last) in enumerate(layout)
    ]


def test_strangers_claiming_a_lineage_neither_take_a_broken_chains_place_nor_stop_it():
    """Identities that claim a chain of their own under a victim's lineage: live (it would have stopped the
    lineage being continued) or newer and broken (it would have been continued in the victim's place)."""
    plan = _formed_chain(stages=2, n_layers=4)
    first, second = plan.members
    layers = [s.layers for s in plan.stages]
    survivor = _broken(_claims(plan)[:1])
    spares = [Candidate("spare", 1.0), Candidate("spare-2", 0.5)]
    live_fake = _strangers_chain(plan.chain, ["sybil-1", "sybil-2"], layers, boundary=6)
    newer_fake = _strangers_chain(plan.chain, ["sybil-3", "sybil-4"], layers, boundary=7, broken={"sybil-3"})
    statuses = chain_status(survivor + live_fake + newer_fake, 2, 4)
    assert any(c.live and c.lineage == plan.chain for c in statuses)  # the strangers' chain is live
    successors, _ = plan_successors(statuses, spares, 2, 4, boundary=8)
    ours = [p for p in successors if first in p.members]
    assert len(ours) == 1 and ours[0].members == (first, "spare") and ours[0].lineage == plan.chain
    assert ours[0].survivors == (first,)
    # the strangers' broken chain is only ever continued with its own members: never with ours
    for other in successors:
        assert other is ours[0] or first not in other.members


def test_a_spare_that_never_stepped_in_is_passed_over_by_the_next_plan():
    """An identity that says it is idle and the fastest is the plan's first spare at every boundary; once a
    survivor names it as planned and never claiming, the chain's next plan takes the next spare."""
    plan = _formed_chain(stages=2, n_layers=4)
    first = plan.members[0]
    spares = [Candidate("sybil", 1000.0), Candidate("spare", 1.0)]
    [survivor] = _broken(_claims(plan)[:1])
    [status] = chain_status([survivor], 2, 4)
    [successor], _ = plan_successors([status], spares, 2, 4, boundary=6)
    assert successor.members == (first, "sybil")
    named = dataclasses.replace(survivor, noshows=("sybil",))
    [status] = chain_status([named], 2, 4)
    assert status.noshows == ("sybil",) and status.live is False
    [successor], left = plan_successors([status], spares, 2, 4, boundary=7)
    assert successor.members == (first, "spare") and [c.peer_id for c in left] == ["sybil"]
    # a member cannot pass over its own chain's members: a name in the layout is no spare anyway
    [status] = chain_status([dataclasses.replace(survivor, noshows=(first,))], 2, 4)
    assert status.noshows == ()


def test_a_member_that_says_nothing_is_not_a_survivor():
    """A departed peer's record outlives it (up to its lifetime): a chain whose only claims come from members
    that do not say it broke is not continued, so nobody is planned into a chain with a dead peer."""
    plan = _formed_chain(stages=2, n_layers=4)
    [status] = chain_status(_claims(plan)[1:], 2, 4)  # the first stage's record is gone, the second silent
    assert not status.live and status.broken == ()
    assert plan_successors([status], [Candidate("spare", 1.0)], 2, 4, boundary=6)[0] == []


def test_a_member_caught_lying_to_its_neighbour_is_left_behind():
    """The receiver of a frame that failed its checks blames the sender: the chain goes on without it; two
    members that blame each other both leave it."""
    plan = _formed_chain(stages=3, n_layers=6)
    first, liar, last = plan.members

    def claim(stage, blame=""):
        s = plan.stages[stage]
        return Claim(s.peer_id, s.chain, s.stage, s.layers, s.layout, "", True, blame)

    # the liar says the chain broke too (its stream ended), but its neighbour caught it
    [status] = chain_status([claim(0), claim(1), claim(2, blame=liar)], 3, 6)
    assert status.blamed == (liar,) and "broken" in status.problem
    [successor], _ = plan_successors([status], [Candidate("spare", 1.0)], 3, 6, boundary=6)
    assert successor.members == (first, "spare", last) and successor.newcomers == ("spare",)
    assert successor.predecessors == ()  # a liar's error feedback is never taken
    # blaming back: both leave, two spares step in
    statuses = chain_status([claim(0), claim(1, blame=last), claim(2, blame=liar)], 3, 6)
    spares = [Candidate("spare-1", 2.0), Candidate("spare-2", 1.0)]
    [both], _ = plan_successors(statuses, spares, 3, 6, boundary=6)
    assert both.members == (first, "spare-1", "spare-2")
    # a blame counts only from a member that says the chain broke, and only against another member
    [quiet] = chain_status([claim(0), claim(1), claim(2, blame="stranger")], 3, 6)
    assert quiet.blamed == ()


# --- pools: a stage held by several workers --------------------------------------------------------------


def test_a_left_over_spare_joins_the_stage_with_the_least_compute_per_layer():
    peers = [Candidate("fast", 4.0), Candidate("second", 2.0), Candidate("spare", 1.0)]
    [plan] = pack_chains(peers, 2, n_layers=5, boundary=3, stage_workers=2)
    pools = stage_pools(plan.stages[0].layout)
    # the two fastest lead, layers split by their compute (3 of 5 on the fast one); per layer the fast
    # stage has 4.0 / 3, the other 2.0 / 2: the spare goes where that is least
    assert pools == ((("fast",), 0, 2), (("second", "spare"), 3, 4))
    assert [(s.peer_id, s.stage, s.layers) for s in plan.stages] == [
        ("fast", 0, (0, 2)),
        ("second", 1, (3, 4)),
        ("spare", 1, (3, 4)),
    ]
    # without room (the default: one worker a stage) the spare stays idle, as before pools
    [single] = pack_chains(peers, 2, n_layers=5, boundary=3)
    assert single.members == ("fast", "second")
    # the plan is the same for any order, and the name commits to the pool
    for seed in range(5):
        shuffled = random.Random(seed).sample(peers, 3)
        assert pack_chains(shuffled, 2, n_layers=5, boundary=3, stage_workers=2) == [plan]
    assert plan.chain != single.chain


def test_pools_fill_before_another_chain_forms_and_never_exceed_the_cap():
    peers = _candidates(9, seed=4)
    plans = pack_chains(peers, 2, n_layers=4, boundary=3, stage_workers=2)
    assert len(plans) == 3  # a chain holds 3 (its second stage a pool of 2): 3 chains hold the 9
    sizes = sorted(len(w) for p in plans for w, _, _ in stage_pools(p.stages[0].layout))
    assert sizes == [1] * 3 + [2] * 3
    wide = pack_chains(_candidates(7, seed=4), 2, n_layers=4, boundary=3, stage_workers=3)
    assert len(wide) == 2 and sum(len(p.members) for p in wide) == 7  # 2 chains of up to 4 hold the 7
    assert all(len(w) <= 3 for p in wide for w, _, _ in stage_pools(p.stages[0].layout))
    three = pack_chains(_candidates(7, seed=4), 3, n_layers=6, boundary=3, stage_workers=2)
    assert len(three) == 2 and sum(len(p.members) for p in three) == 7  # a chain holds 5: two for 7
    # one worker a stage (the default): as many chains as fit, as before pools
    assert len(pack_chains(_candidates(9, seed=4), 2, n_layers=4, boundary=3)) == 4


def test_a_pool_keeps_its_chain_live_while_one_worker_is_left():
    peers = [Candidate("a", 4.0), Candidate("b", 1.0), Candidate("c", 1.0)]
    [plan] = pack_chains(peers, 2, n_layers=4, boundary=3, stage_workers=2)
    claims = _claims(plan)
    [status] = chain_status(claims, 2, 4, stage_workers=2)
    assert status.live and status.workers == (("a",), ("b", "c"))
    assert status.stages == ("a", "b")
    # one of the pool leaves (its record expired), or says its training ended: still live
    [status] = chain_status([c for c in claims if c.peer_id != "b"], 2, 4, stage_workers=2)
    assert status.live and status.workers == (("a",), ("c",))
    [status] = chain_status(_broken(claims[2:]) + claims[:2], 2, 4, stage_workers=2)
    assert status.live and status.workers == (("a",), ("b",)) and status.broken == ("c",)
    # the lone first stage leaves: not live
    [status] = chain_status(claims[1:], 2, 4, stage_workers=2)
    assert not status.live and status.problem == "stage 0 has no member"
    # a run that allows one worker a stage takes no pool
    [status] = chain_status(claims, 2, 4)
    assert not status.live and "allows 1" in status.problem


def test_a_pool_worker_caught_lying_stops_working_but_the_chain_goes_on():
    peers = [Candidate("a", 4.0), Candidate("b", 1.0), Candidate("c", 1.0)]
    [plan] = pack_chains(peers, 2, n_layers=4, boundary=3, stage_workers=2)
    a, b, c = _claims(plan)
    accused = Claim(a.peer_id, a.chain, a.stage, a.layers, a.layout, blame="c")
    [status] = chain_status([accused, b, c], 2, 4, stage_workers=2)
    assert status.live and status.blamed == ("c",) and status.workers == (("a",), ("b",))
    # a stranger's blame counts for nothing
    stranger = Claim("x", a.chain, 0, a.layers, a.layout, blame="c")
    [status] = chain_status([a, b, c, stranger], 2, 4, stage_workers=2)
    assert status.blamed == ()


def test_a_claim_at_the_wrong_stage_of_a_pool_commits_to_nothing():
    peers = [Candidate("a", 4.0), Candidate("b", 1.0), Candidate("c", 1.0)]
    [plan] = pack_chains(peers, 2, n_layers=4, boundary=3, stage_workers=2)
    a, b, c = _claims(plan)
    wrong = Claim(c.peer_id, c.chain, 0, c.layers, c.layout)
    [status] = chain_status([a, b, wrong], 2, 4, stage_workers=2)
    assert status.workers == (("a",), ("b",))
    assert stage_of(c.layout, "c") == 1 and stage_of(c.layout, "x") is None


def test_a_successor_keeps_the_surviving_pool_and_fills_only_empty_stages():
    peers = [Candidate("a", 4.0), Candidate("b", 1.0), Candidate("c", 1.0)]
    [plan] = pack_chains(peers, 2, n_layers=4, boundary=3, stage_workers=2)
    claims = _broken([c for c in _claims(plan) if c.peer_id != "a"])  # the lone first stage left
    [status] = chain_status(claims, 2, 4, stage_workers=2)
    compute = {"b": 1.0, "c": 1.0}
    [successor] = plan_boundary([status], [Candidate("s", 3.0)], 2, 4, 4, 2, compute)
    assert stage_pools(successor.stages[0].layout) == ((("s",), *plan.stages[0].layers), (("b", "c"), 3, 3))
    assert successor.lineage == plan.chain and successor.newcomers == ("s",)
    # the spare left over: the second stage's pool is full, the first stage takes no pool
    plans = plan_boundary([status], [Candidate("s", 3.0), Candidate("t", 0.5)], 2, 4, 4, 3, compute)
    assert stage_pools(plans[0].stages[0].layout)[1][0] == ("b", "c", "t")
    plans = plan_boundary([status], [Candidate("s", 3.0), Candidate("t", 0.5)], 2, 4, 4, 2, compute)
    assert "t" not in plans[0].members


def test_the_first_stage_takes_no_pool():
    # per layer the first stage is the slowest (1 layer of 1.0 against 3 of 9.0): the spare still goes on
    peers = [Candidate("a", 9.0), Candidate("b", 9.0), Candidate("c", 1.0)]
    [plan] = pack_chains(peers, 2, n_layers=4, boundary=3, stage_workers=2)
    assert [len(w) for w, _, _ in stage_pools(plan.stages[0].layout)] == [1, 2]


def test_a_live_chain_takes_a_spare_into_its_pool_and_keeps_its_lineage():
    [plan] = pack_chains([Candidate("a", 4.0), Candidate("b", 2.0)], 2, n_layers=4, boundary=3)
    [status] = chain_status(_claims(plan), 2, 4, stage_workers=2)
    assert status.live
    compute = {"a": 4.0, "b": 2.0}
    [grown] = plan_boundary([status], [Candidate("s", 1.0)], 2, 4, 5, 2, compute)
    assert grown.lineage == plan.chain and grown.chain.startswith("c5-")
    assert grown.survivors == ("a", "b") and grown.newcomers == ("s",)
    assert stage_pools(grown.stages[0].layout) == ((("a",), 0, 2), (("b", "s"), 3, 3))
    # the members keep their stages and layers: their local state stays valid
    assert {(s.peer_id, s.stage, s.layers) for s in grown.stages} >= {
        (s.peer_id, s.stage, s.layers) for s in plan.stages
    }
    # one worker a stage: a live chain takes nobody; two idle peers then form a chain of their own
    assert plan_boundary([status], [Candidate("s", 1.0)], 2, 4, 5, 1, compute) == []
    # a chain formed at this very boundary is still forming: it grows at a later one
    assert plan_boundary([status], [Candidate("s", 1.0)], 2, 4, 3, 2, compute) == []


def test_a_growing_chain_leaves_its_departed_workers_behind():
    peers = [Candidate("a", 4.0), Candidate("b", 2.0), Candidate("c", 1.0)]
    [plan] = pack_chains(peers, 2, n_layers=4, boundary=3, stage_workers=3)
    claims = [c for c in _claims(plan) if c.peer_id != "c"]  # c left; the chain lives on with b
    [status] = chain_status(claims, 2, 4, stage_workers=3)
    [grown] = plan_boundary([status], [Candidate("s", 1.0)], 2, 4, 6, 3, {"a": 4.0, "b": 2.0})
    assert stage_pools(grown.stages[0].layout)[1][0] == ("b", "s") and "c" not in grown.members


def test_a_chain_takes_back_no_peer_its_members_caught_lying():
    [plan] = pack_chains([Candidate("a", 4.0), Candidate("b", 2.0)], 2, n_layers=4, boundary=3)
    a, b = _claims(plan)
    accusing = Claim(a.peer_id, a.chain, a.stage, a.layers, a.layout, blame="liar")
    [status] = chain_status([accusing, b], 2, 4, stage_workers=2)
    assert status.live and status.accused == ("liar",) and status.blamed == ()  # not in the layout
    idle = [Candidate("liar", 9.0), Candidate("s", 1.0)]
    [grown] = plan_boundary([status], idle, 2, 4, 5, 2, {"a": 4.0, "b": 2.0})
    assert grown.newcomers == ("s",)  # the faster idle peer is the one it caught
    assert plan_boundary([status], idle[:1], 2, 4, 5, 2, {"a": 4.0, "b": 2.0}) == []


def test_members_follow_the_chain_their_spares_claim_whatever_boundary_named_it():
    [plan] = pack_chains([Candidate("a", 4.0), Candidate("b", 2.0)], 2, n_layers=4, boundary=3)
    [ours] = chain_status(_claims(plan), 2, 4, stage_workers=2)
    compute = {"a": 4.0, "b": 2.0}
    # the spare planned at boundary 7, the members read the records at boundary 8 (or 6): same chain
    [grown] = plan_boundary([ours], [Candidate("s", 1.0)], 2, 4, 7, 2, compute)
    spare = [c for c in _successor_claims(grown) if c.peer_id == "s"]
    statuses = chain_status(_claims(plan) + spare, 2, 4, stage_workers=2)
    assert grown_successor(ours, statuses, 2).chain == grown.chain
    # not before the spare claims it, nor past the cap
    assert grown_successor(ours, chain_status(_claims(plan), 2, 4, stage_workers=2), 2) is None
    assert grown_successor(ours, statuses, 1) is None
    # a stranger claiming an extension with itself in a pool is no spare the members caught lying
    accusing = Claim("a", plan.chain, 0, (0, 2), plan.stages[0].layout, blame="s")
    [accuser] = chain_status([accusing, _claims(plan)[1]], 2, 4, stage_workers=2)
    assert grown_successor(accuser, statuses, 2) is None


def test_a_member_follows_the_successor_a_spare_claimed_a_boundary_before_it_looked():
    """The spare read the break at boundary 6 and claimed the successor; the members planned boundary 6
    before the break and see, at 7, no idle spare: they follow the spare's claim instead of dissolving."""
    plan = _formed_chain()
    gone, stays = plan.members[1], plan.members[0]
    ours = _broken(c for c in _claims(plan) if c.peer_id != gone)
    [status] = chain_status(ours, 3, 6)
    [successor], _ = plan_successors([status], [Candidate("spare", 5.0)], 3, 6, boundary=6)
    spare_claim = [c for c in _successor_claims(successor) if c.peer_id == "spare"]
    chains = chain_status(ours + spare_claim, 3, 6)
    mine = next(c for c in chains if c.chain == plan.chain)
    found = stepped_in_successor(mine, chains, stays)
    assert found is not None and found.chain == successor.chain and found.lineage == plan.chain
    # the peer that left is in no successor's stage of ours
    assert stepped_in_successor(mine, chains, gone) is None
    # not a chain under another lineage
    stranger = [
        Claim(c.peer_id, c.chain, c.stage, c.layers, c.layout, "c1-other", False) for c in spare_claim
    ]
    assert stepped_in_successor(mine, chain_status(ours + stranger, 3, 6), stays) is None
    # nor one whose newcomer does not claim it (yet)
    assert stepped_in_successor(mine, chain_status(ours, 3, 6), stays) is None
