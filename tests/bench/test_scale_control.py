"""The control-plane model: today's scheme, the code's stretched heartbeats and reads, the target."""

import pytest

from hetnode.bench import scale_control as sc

SIZES = sc.RecordSizes(peer_today=1300.0, peer_event=900.0, announce=600.0, seal=74_000.0)
MODEL = sc.ControlModel()


def test_seal_polls_back_off_to_the_heartbeat():
    assert sc.seal_reads(20.0, MODEL) == 22  # one a second, plus the first and the nudged read
    # 1, 1, 2, 2, 4, 4 s: 14 s of waiting, then the next poll (8 s) comes after the 20 s wait
    assert sc.seal_reads(20.0, MODEL, backoff_to_s=10.0) == 8
    assert sc.seal_reads(0.5, MODEL, backoff_to_s=10.0) == sc.seal_reads(0.5, MODEL) == 2


@pytest.mark.parametrize("peers", [9, 33, 129, 385])
def test_stretched_heartbeats_cost_less_than_today_and_more_than_the_target(peers):
    today = sc.today(peers, peers - 1, SIZES, 20.0, MODEL)
    stretched = sc.stretched(peers, peers - 1, SIZES, 20.0, MODEL)
    target = sc.target(peers, peers - 1, 4, SIZES, MODEL)
    assert target.per_peer < stretched.per_peer < today.per_peer


def test_the_stretched_scheme_gains_more_the_larger_the_swarm_but_still_grows_with_it():
    def ratio(peers):
        today = sc.today(peers, peers - 1, SIZES, 20.0, MODEL).per_peer
        return today / sc.stretched(peers, peers - 1, SIZES, 20.0, MODEL).per_peer

    assert ratio(385) > ratio(33) > ratio(9) > 1.0
    small, large = (sc.stretched(n, n - 1, SIZES, 20.0, MODEL).per_peer for n in (9, 385))
    assert large > small  # a read still moves every record: per-peer cost is O(N), not O(log N)


def test_the_digest_check_reads_one_small_entry_not_the_swarms_records():
    from dataclasses import replace

    peers = 257
    with_head = replace(SIZES, head=700.0)
    extra = (
        sc.stretched(peers, peers - 1, with_head, 20.0, MODEL).total
        - sc.stretched(peers, peers - 1, SIZES, 20.0, MODEL).total
    )
    assert extra / peers == pytest.approx(MODEL.dht_replicas * 700.0)  # per replica read, and one store
    lookup = sc.lookup_rpcs_today(peers, MODEL) * MODEL.rpc_bytes
    check = lookup + MODEL.dht_replicas * 700.0
    assert check < 0.2 * (lookup + MODEL.dht_replicas * peers * SIZES.peer_today)  # a read of every record


def test_the_head_entry_is_sized_like_the_records_the_code_writes():
    shards = ["embed", "head", *map(str, range(18))]
    sizes = sc.record_sizes(shards, [tuple(shards[:11]), tuple(shards[11:])], 4, 2, 74_000)
    assert sc.RECORD_OVERHEAD_BYTES < sizes.head < sizes.peer_today
