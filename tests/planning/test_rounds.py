"""When to seal: every expected replica in, or the learned deadline after the first announcement."""

import pytest

from hetnode.planning.rounds import Announcement, ArrivalDeadline, seal_now, sealed_order


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
