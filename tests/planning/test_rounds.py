"""When to seal: every expected replica in, or the learned deadline after the first announcement."""

import pytest

from hetnode.planning.roles import ChainStatus
from hetnode.planning.rounds import (
    Announcement,
    ArrivalDeadline,
    FetchDeadline,
    chains_at_open,
    held_back_s,
    lost_records,
    restarted_chains,
    seal_now,
    sealed_order,
)


def announced(*peers, at=0.0):
    return {p: Announcement(p, 3, {"embed": "0" * 64}, 100, at + i) for i, p in enumerate(peers)}


def test_seals_when_every_expected_replica_announced():
    assert seal_now({"a", "b"}, announced("a", "b"), now=1.0, deadline_s=60)
    assert seal_now({"a"}, announced("a", "x"), now=1.0, deadline_s=60)  # an extra one does not block
    assert not seal_now({"a", "b"}, announced("a"), now=1.0, deadline_s=60)
    assert not seal_now({"a"}, {}, now=100.0, deadline_s=1)  # nothing to seal


def test_seals_without_a_straggler_once_the_deadline_passed():
    seen = announced("a", at=10.0)
    assert not seal_now({"a", "b"}, seen, now=14.9, deadline_s=5)
    assert seal_now({"a", "b"}, seen, now=15.0, deadline_s=5)


def test_deadline_is_learned_from_arrival_spreads_and_clamped():
    deadline = ArrivalDeadline(floor_s=1.0, ceiling_s=30.0, factor=2.0)
    assert deadline.seconds == 30.0  # nothing observed yet: be patient
    deadline.observe(0.1)
    assert deadline.seconds == pytest.approx(1.0)  # floor
    deadline.observe(4.0)
    assert deadline.seconds == pytest.approx(8.0)  # 2 x the slowest recent spread
    deadline.observe(100.0)
    assert deadline.seconds == 30.0  # ceiling
    for _ in range(8):  # old rounds fall out of the window
        deadline.observe(0.5)
    assert deadline.seconds == pytest.approx(1.0)


def test_deadline_floor_follows_the_round_length():
    deadline = ArrivalDeadline(floor_s=1.0, ceiling_s=60.0)
    deadline.observe(0.0)  # one replica: no spread at all
    assert deadline.seconds == pytest.approx(1.0)
    for duration in (10.0, 12.0, 11.0):
        deadline.observe_round(duration)
    assert deadline.seconds == pytest.approx(0.5 * 11.0)  # a late rejoiner still makes the round


def test_sealed_order_is_by_peer_id_whatever_the_arrival_order():
    seen = announced("c", "a", "b")
    assert [a.peer_id for a in sealed_order(seen.values())] == ["a", "b", "c"]


def test_assigned_batches_are_public_and_differ_between_replicas_of_one_slot():
    from hetnode.planning.rounds import assigned_batches

    first = assigned_batches("peer-a", 3, 10)
    assert first == assigned_batches("peer-a", 3, 10) and len(first) == 10  # anyone can recompute them
    assert assigned_batches("peer-a", 4, 10).start == first.stop  # rounds follow one another
    # two replicas (often on one of the 256 data slots) start far apart: they never train the same batches
    starts = {assigned_batches(f"peer-{i}", 0, 10).start for i in range(200)}
    assert len(starts) == 200


def test_the_clock_starts_with_a_trusted_expected_replica_never_a_stranger():
    seen = announced("a", "x")
    seen["x"] = Announcement("x", 0, {}, 1, seen_at=0.0)  # a stranger, first
    seen["a"] = Announcement("a", 0, {}, 1, seen_at=50.0)
    # the stranger announced 55 s ago, but the round's clock started with a at 50
    assert not seal_now({"a", "b"}, seen, now=55.0, deadline_s=10, ceiling_s=100, trusted={"a"})
    assert seal_now({"a", "b"}, seen, now=60.0, deadline_s=10, ceiling_s=100, trusted={"a"})
    # a Sybil claiming to be expected but never sealed before does not start it either
    assert not seal_now({"a", "b", "x"}, seen, now=55.0, deadline_s=10, ceiling_s=100, trusted={"a"})
    # nor before the trusted replica announced
    early = {"x": Announcement("x", 0, {}, 1, seen_at=0.0)}
    assert not seal_now({"a", "x"}, early, now=99.0, deadline_s=10, ceiling_s=100, trusted={"a"})
    # only strangers: the ceiling
    alone = {"x": seen["x"]}
    assert not seal_now({"a"}, alone, now=99.0, deadline_s=10, ceiling_s=100)
    assert seal_now({"a"}, alone, now=100.0, deadline_s=10, ceiling_s=100)


def test_the_fetch_deadline_admits_the_slowest_admitted_link_and_a_median_not_a_few_slow_ones():
    floor = FetchDeadline.floor_for(max_bytes=5_000_000, min_mbps=5.0, base_s=1.0)
    assert floor == pytest.approx(1.0 + 16.0)  # 5 MB at 5 Mbit/s, twice
    deadline = FetchDeadline(floor_s=2.0, ceiling_s=60.0)
    assert deadline.seconds == 2.0
    for took in (1.0, 1.0, 1.0, 50.0, 50.0):  # two slow identities among three honest authors
        deadline.observe(took)
    assert deadline.seconds == pytest.approx(4.0)
    for _ in range(10):
        deadline.observe(100.0)
    assert deadline.seconds == 60.0


def test_a_late_author_is_held_back_longer_each_round_it_stays_late():
    assert [held_back_s(n, 5.0, 120.0) for n in (1, 2, 3, 4, 5, 6)] == [5, 10, 20, 40, 80, 120]


def test_a_replica_whose_record_the_dht_lost_is_still_waited_for_until_it_misses_a_round():
    before = {"a", "b", "c", "d"}
    # b's record is gone without a word (hidden or dropped), c left (offline record), d missed a round
    assert lost_records(before, in_view={"a"}, departed={"c"}, missed={"d"}) == {"b"}
    assert lost_records(before, in_view=before, departed=(), missed=()) == set()  # all there: none lost


def chain(name, *members, live=True, lineage=""):
    layout = tuple((peer, 2 * i, 2 * i + 1) for i, peer in enumerate(members))
    return ChainStatus(name, live, tuple(members), "" if live else "broken", lineage or name, layout)


def test_a_chain_that_dropped_its_round_in_flight_is_not_waited_for():
    opened = chains_at_open([chain("c3", "s0", "s1"), chain("c5", "t0", "t1"), chain("c7", "u0", live=False)])
    assert set(opened) == {"c3", "c5"}  # a chain not live as the round opened is not waited for anyway
    # nothing happened: nobody's round is dropped
    assert restarted_chains(opened, [chain("c3", "s0", "s1"), chain("c5", "t0", "t1")]) == set()
    # c3's second member left and a spare stepped in: a successor of c3's lineage restarts the round
    now = [chain("c9", "s0", "spare", lineage="c3"), chain("c5", "t0", "t1")]
    assert restarted_chains(opened, now) == {"s0", "s1", "spare"}
    # c3 broke and nobody stepped in yet
    broke = [chain("c3", "s0", "s1", live=False), chain("c5", "t0", "t1")]
    assert restarted_chains(opened, broke) == {"s0", "s1"}
    # c3 grew a pool: all its members go on, the round too
    grown = [chain("c9", "s0", "s1", "w", lineage="c3"), chain("c5", "t0", "t1")]
    assert restarted_chains(opened, grown) == set()
