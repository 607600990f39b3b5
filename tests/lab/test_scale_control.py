"""The control-plane model: today's scheme, the code's stretched heartbeats and reads, the target."""

import pytest

from hetnode.lab.scale import control as sc

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


def test_under_churn_a_replica_reads_the_change_log_and_every_record_only_when_further_behind():
    """2 % of peers change each round. A refresh that meets a change reads the coordinator's change log,
    not every record, while its period holds fewer coordinator steps than the log keeps (6 reads of the
    coordinator per stretched refresh, 8 steps kept); a log of 2 steps, or replicas that refresh every
    240 s (24 coordinator reads), fall behind it and read every record again."""
    from dataclasses import replace

    peers = 513
    stable = sc.vouched(peers, peers - 1, SIZES, 20.0, MODEL)
    churn = sc.vouched(peers, peers - 1, SIZES, 20.0, MODEL, churn=True)
    log = sc.change_log(MODEL.event_rate * peers, 1.0, SIZES, MODEL)
    assert log.behind == 0.0 and log.meets > 0.99 and log.entry < 20_000
    assert stable.per_peer < churn.per_peer < 1.2 * stable.per_peer
    for model in (replace(MODEL, change_steps=2), replace(MODEL, stretched_heartbeat_s=240.0)):
        refreshes = model.round_period_s / model.stretched_heartbeat_s
        behind = sc.change_log(MODEL.event_rate * peers, refreshes, SIZES, model)
        assert behind.behind > 0.95 * behind.meets
        assert sc.vouched(peers, peers - 1, SIZES, 20.0, model, churn=True).per_peer > 1.5 * churn.per_peer
    # the entry never passes its cap: at 20,000 peers a step holds ~67 records, so steps are dropped or not
    # logged at all, and every refresh that meets a change reads every record
    crowd = sc.change_log(MODEL.event_rate * 20_000, 1.0, SIZES, MODEL)
    assert crowd.entry <= MODEL.change_log_bytes + sc.RECORD_OVERHEAD_BYTES and crowd.behind == crowd.meets
