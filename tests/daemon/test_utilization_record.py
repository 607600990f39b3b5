"""A replica's compute utilisation, from its round records to what people read: the rolling figure over
its last rounds, the bounded field of its peer record (refused by the DHT's schema check outside 0..1),
and its cell in `hetnode status`."""

from __future__ import annotations

import time

import pytest
from hivemind.dht.routing import DHTID
from hivemind.dht.validation import DHTRecord
from hivemind.utils import MSGPackSerializer

from hetnode.daemon.status import format_share, render_table
from hetnode.net.identity import ephemeral_identity, owner_subkey
from hetnode.net.records import PeerRecord, new_peer_record, record_key, run_schema_validator
from hetnode.service.round_log import RoundRecord, log_utilization, record_from_log, rolling_utilization


def rounds(train_s: float, sync_s: float, n: int, started: bool = True) -> list[RoundRecord]:
    """Lockstep rounds: train `train_s`, then `sync_s` waiting for the seal and applying it."""
    period = train_s + sync_s
    return [
        RoundRecord(r, "anchor", train_s, 1000, 0, time=100 + r * period + train_s,
                    started_at=100 + r * period if started else 0.0)
        for r in range(n)
    ]  # fmt: skip


def test_rolling_utilisation_reads_the_newest_rounds():
    assert rolling_utilization(rounds(6.0, 4.0, 3)) == pytest.approx(round(18 / 26, 3))
    # a slow start does not weigh forever: only the newest rounds count
    slow = rounds(1.0, 9.0, 10)
    fast = [
        RoundRecord(10 + r, "anchor", 9.0, 1, 0, time=200 + 10 * r + 9, started_at=200 + 10 * r)
        for r in range(8)
    ]
    assert rolling_utilization(slow + fast, last=8) == pytest.approx(round(72 / 79, 3))
    assert rolling_utilization(rounds(6.0, 4.0, 3, started=False)) == pytest.approx(round(18 / 26, 3))
    assert rolling_utilization(rounds(6.0, 4.0, 1)) is None and rolling_utilization([]) is None
    overlapping = [
        RoundRecord(r, "anchor", 10.0, 1, 0, time=100 + 9 * r, started_at=91 + 9 * r) for r in range(3)
    ]
    assert rolling_utilization(overlapping) == 1.0  # clamped: a share, whatever the clocks say


def test_a_round_log_line_reads_back_as_its_record():
    record = RoundRecord(3, "stage", 2.5, 512, 100, started_at=7.0, train_wait_s=0.5, overlap=True)
    line = {**record.__dict__, "tokens_per_s": 204.8}  # what append_round writes
    assert record_from_log(line) == record


def test_the_peer_record_takes_a_share_or_null_and_nothing_else():
    for value in (None, 0.0, 0.5, 1.0):
        assert PeerRecord.parse_obj(new_peer_record("a", utilization=value)).utilization == value
    assert PeerRecord.parse_obj({k: v for k, v in new_peer_record("a").items() if k != "utilization"})
    for value in (1.01, -0.1, "0.5", float("nan")):
        with pytest.raises(ValueError):
            PeerRecord.parse_obj(new_peer_record("a", utilization=value))


def test_every_dht_node_refuses_a_utilisation_outside_its_bounds():
    validator = run_schema_validator("run")
    key = DHTID.generate(source=record_key("run", "peers")).to_bytes()
    subkey = MSGPackSerializer.dumps(owner_subkey(ephemeral_identity()))

    def stored(value: object) -> bool:
        record = new_peer_record("a", role="anchor", utilization=value)
        return validator.validate(DHTRecord(key, subkey, MSGPackSerializer.dumps(record), time.time() + 30))

    assert stored(0.93) and stored(None)
    assert not stored(1.5) and not stored(1)  # strict: an int is not the float the schema asks for


def test_status_shows_each_replicas_utilisation():
    assert format_share(0.934) == "93%" and format_share(1.0) == "100%"
    assert format_share(None) == format_share("0.9") == format_share(1.5) == format_share(True) == "-"
    peer = {"peer_id": "x" * 46, "name": "anchor-1", "role": "anchor", "params_round": 3, "utilization": 0.5}
    table = render_table({"run": "r", "time": 0.0, "peers": [peer, {**peer, "utilization": None}]})
    header, first, second = table.split("\n")[2:5]
    column = header.index(" util") + 1
    assert first[column : column + 4].strip() == "50%" and second[column : column + 4].strip() == "-"


def test_log_lines_give_the_whole_runs_figure_or_none_when_they_lack_their_times():
    lines = [{**r.__dict__, "tokens_per_s": 1.0} for r in rounds(6.0, 4.0, 3)]
    assert log_utilization(lines) == pytest.approx(round(18 / 26, 3))
    assert log_utilization(lines, last=2) == pytest.approx(round(12 / 16, 3))
    assert log_utilization([{"round": 0, "tokens": 1}]) is None  # no train_s, no time
    assert log_utilization([lines[0], {**lines[1], "time": "noon"}]) is None
