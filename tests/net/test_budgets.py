"""Budgets, refusal logging, record caps and the state cache as pure logic: fake clocks, no sockets."""

import asyncio
import logging
import threading
import time
from pathlib import Path

import pytest
from hivemind.dht.routing import DHTID
from hivemind.dht.validation import DHTRecord
from hivemind.utils import MSGPackSerializer

from hetnode.config import load_config
from hetnode.net.budgets import Budgets, ByteBudget, NodeBudgets, Refused, StreamScope
from hetnode.net.identity import ephemeral_identity, owner_subkey
from hetnode.net.log_limits import RefusalLog
from hetnode.net.records import (
    MAX_RECORD_BYTES,
    MAX_SHARDS,
    MAX_TTL_S,
    AnnounceRecord,
    PeerRecord,
    RecordCapsValidator,
    cap_problem,
    new_head_record,
    record_key,
)
from hetnode.net.state_cache import StateCache

CONFIGS = Path(__file__).resolve().parents[2] / "configs"
MiB = 2**20


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


# --- streams -------------------------------------------------------------------------------------------


def test_stream_slots_per_peer_and_global_are_reserved_and_released():
    scope = StreamScope(per_peer=2, total=3)
    a1, a2 = scope.reserve("a"), scope.reserve("a")
    assert a1 and a2 and scope.reserve("a") is None and scope.refused_by("a") == "peer"
    b1 = scope.reserve("b")
    assert b1 and scope.reserve("c") is None and scope.refused_by("c") == "global"
    a1.release()
    a1.release()  # twice is once
    assert scope.in_use == 2 and scope.held_by("a") == 1
    with scope.reserve("c") as c1:
        assert c1.peer == "c" and scope.in_use == 3
    assert scope.in_use == 2 and scope.held_by("c") == 0


# --- bytes ---------------------------------------------------------------------------------------------


def test_byte_budget_charges_both_scopes_or_neither_and_refills_over_a_minute():
    clock = FakeClock()
    budget = ByteBudget(per_peer=100, total=150, clock=clock)
    assert budget.charge("a", 60) is None and budget.charge("a", 40) is None
    assert budget.charge("a", 1) == "peer"
    assert budget.charge("b", 60) == "global"  # 50 left in total
    assert budget.left("b") == (100.0, 50.0)  # the refused charge took nothing
    assert budget.charge("b", 50) is None
    clock.now += 30.0  # half a minute: half of each bucket
    assert budget.left("a") == (50.0, 75.0)
    clock.now += 3600.0  # never more than one minute's worth
    assert budget.left("a") == (100.0, 150.0)


def test_byte_budget_forgets_idle_peers_but_keeps_busy_ones(monkeypatch):
    monkeypatch.setattr("hetnode.net.budgets.MAX_TRACKED_PEERS", 10)
    clock = FakeClock()
    budget = ByteBudget(per_peer=100, total=10**9, clock=clock)
    assert budget.charge("busy", 100) is None
    for i in range(20):
        budget.charge(f"idle{i}", 0)  # a zero charge leaves the bucket full
    assert budget.charge("busy", 1) == "peer"  # not forgotten: forgetting would refill it


def test_budgets_spend_raises_a_budget_refusal_and_counts_it():
    clock = FakeClock()
    budgets = Budgets(NodeBudgets(state_bytes_per_peer=10 * MiB, state_bytes_global=100 * MiB), clock=clock)
    budgets.spend("state", "a", 6 * MiB)
    with pytest.raises(Refused, match="state budget") as refused:
        budgets.spend("state", "a", 6 * MiB)
    assert refused.value.code == "budget" and budgets.refusals["budget:state"] == 1
    budgets.spend("payload", "a", 6 * MiB)  # channels are separate


def test_reconfigured_budgets_keep_open_slots_and_what_is_left():
    clock = FakeClock()
    budgets = Budgets(
        NodeBudgets(streams_per_peer=4, probe_bytes_per_peer=100, probe_bytes_global=1000), clock
    )
    held = [budgets.streams.reserve("a") for _ in range(3)]
    budgets.spend("probe", "a", 30)
    budgets.reconfigure(NodeBudgets(streams_per_peer=2, probe_bytes_per_peer=50, probe_bytes_global=1000))
    assert budgets.streams.reserve("a") is None  # 3 open, 2 allowed now
    held[0].release()
    held[1].release()
    assert budgets.streams.reserve("a") is not None
    assert budgets.bytes["probe"].left("a") == (50.0, 970.0)  # 70 left, capped at the new 50
    clock.now += 60.0
    assert budgets.bytes["probe"].left("a") == (50.0, 1000.0)


def test_sized_budgets_cover_the_largest_reply_and_two_probes():
    budgets = NodeBudgets.sized(probe_bytes=4 * MiB, max_frame_bytes=512 * MiB)
    for channel in ("payload", "state"):
        per_peer, total = budgets.bytes_per_minute(channel)
        assert 512 * MiB <= per_peer <= total  # a frame always fits a full bucket
    assert budgets.bytes_per_minute("probe") == (16 * MiB, 256 * MiB)
    assert NodeBudgets() == NodeBudgets.sized(4 * MiB, 64 * MiB)  # the defaults are the default shape


# --- refusal log ---------------------------------------------------------------------------------------


def test_refusal_log_says_once_per_peer_and_reason_then_sums_up(caplog):
    clock = FakeClock()
    refusals = RefusalLog(logging.getLogger("test.refusals"), period_s=60.0, max_lines=3, clock=clock)
    with caplog.at_level(logging.WARNING, logger="test.refusals"):
        assert refusals.warning("a", "busy", "busy %s", "a")
        for _ in range(100):
            assert not refusals.warning("a", "busy", "busy %s", "a")
        assert refusals.warning("a", "budget", "budget %s", "a")  # another reason
        assert refusals.warning("b", "busy", "busy %s", "b")
        assert not refusals.warning("c", "busy", "busy %s", "c")  # 3 lines this minute in all
        assert len(caplog.records) == 3 and refusals.suppressed() == 101
        clock.now += 61.0
        assert refusals.warning("a", "busy", "busy %s", "a")
    lines = [r.getMessage() for r in caplog.records]
    assert lines[3].startswith("101 refusals suppressed in the last 61 s (busy 101)")
    assert lines[4] == "busy a" and len(lines) == 5


# --- record caps ---------------------------------------------------------------------------------------


def _record(field, value, ttl_s, now, subkey=b"[owner:k]"):
    key = DHTID.generate(source=record_key("run", field)).to_bytes()
    return DHTRecord(key, MSGPackSerializer.dumps(subkey), MSGPackSerializer.dumps(value), now + ttl_s)


def test_caps_validator_refuses_long_lives_and_heavy_values_of_the_run_only():
    clock = FakeClock()
    validator = RecordCapsValidator("run", clock=clock)
    seal = {"round": 1, "contributions": [], "excluded": [], "sealed_at": 0.0, "prev": ""}
    assert validator.validate(_record("seal", seal, 3600.0, clock.now))
    assert not validator.validate(_record("seal", seal, 10 * 365 * 86400.0, clock.now))
    assert not validator.validate(_record("peers", {"x": "y" * 5000}, 30.0, clock.now))
    assert validator.validate(_record("peers", {"x": "y" * 3000}, 30.0, clock.now))
    assert not validator.validate(
        _record("peers", {}, 30.0, clock.now, subkey=b"[owner:" + b"k" * 2000 + b"]")
    )
    other_run = DHTRecord(
        DHTID.generate(source="other_seal").to_bytes(), b"", b"x" * 10**6, clock.now + 10**9
    )
    assert validator.validate(other_run)  # not ours to judge: the schema validator refuses unknown keys
    assert validator.priority > 10  # checked before the RSA signature: a refusal costs no verification


def test_only_the_coordinator_may_store_head_and_changes_entries_once_it_is_known():
    clock = FakeClock()
    coordinator, stranger = ephemeral_identity(), ephemeral_identity()
    head = new_head_record(3, {"embed": "0" * 16}, "0" * 16)

    def by(identity, field="head", value=head):
        return _record(field, value, 60.0, clock.now, subkey=owner_subkey(identity))

    validator = RecordCapsValidator("run", clock=clock, coordinator=coordinator.peer_id)
    assert validator.validate(by(coordinator))
    assert not validator.validate(by(stranger))  # a thousand strangers cannot fill the key's reply
    assert not validator.validate(by(stranger, "changes", {"at": 0.0, "steps": []}))
    assert not validator.validate(_record("head", head, 600.0, clock.now, subkey=b"no owner"))
    assert validator.validate(by(stranger, "peers", {"x": "y"}))  # other fields: anyone, own subkey
    # before the coordinator is known (a node still joining), the field is open as the others are
    assert RecordCapsValidator("run", clock=clock).validate(by(stranger))


def test_only_the_coordinator_and_its_stand_ins_may_store_seals_and_only_it_the_manifest():
    clock = FakeClock()
    coordinator, stand_in, stranger = ephemeral_identity(), ephemeral_identity(), ephemeral_identity()
    seal = {"round": 1, "contributions": [], "excluded": [], "sealed_at": 0.0, "prev": ""}

    def by(identity, field="seal", value=seal):
        return _record(field, value, 60.0, clock.now, subkey=owner_subkey(identity))

    validator = RecordCapsValidator("run", clock=clock, coordinator=coordinator.peer_id)
    assert validator.validate(by(stranger))  # the stand-ins are not known before the manifest is read
    validator.sealers = frozenset({stand_in.peer_id})
    assert validator.validate(by(coordinator)) and validator.validate(by(stand_in))
    assert not validator.validate(by(stranger))  # strangers' seals would push the key past a reply
    manifest = {"protocol": 0, "run": "run", "body": b"x"}
    assert validator.validate(by(coordinator, "manifest", manifest))
    assert not validator.validate(by(stand_in, "manifest", manifest))


def test_cap_problem_on_read():
    now = 1000.0
    assert cap_problem("round", {"round": 1}, now + 100, now) is None
    assert "cap" in cap_problem("round", {"round": 1}, now + 10**8, now)
    assert "bytes" in cap_problem("round", {"round": "x" * 300}, now + 100, now)


def _peer_record(n_shards: int, digest_chars: int = 16, stages: int = 0) -> dict:
    shards = ["embed", "head", *map(str, range(n_shards - 2))]
    return {
        "name": "n" * 64,
        "link_class": "high",
        "up_mbps": 1000.0,
        "down_mbps": 1000.0,
        "rtt_ms": 10.0,
        "mem_gb": 80.0,
        "device": "cuda",
        "tflops": 100.0,
        "wants": "anchor",
        "role": "anchor",
        "chain": "c" * 64,
        "stage": 3,
        "layers": [0, 18],
        "chain_layout": [f"Qm{'x' * 44}:{i * 3}-{i * 3 + 2}" for i in range(stages)] or None,
        "outer_step": 10**6,
        "last_seen": time.time(),
        "version": 1,
        "params_round": 10**6,
        "layer_digests": {s: "a" * digest_chars for s in shards},
        "tokens": 2**40,
        "utilization": 1.0,
        "floor_s": 86400.0,
    }


def test_shard_dicts_have_at_most_1026_items():
    PeerRecord.parse_obj(_peer_record(MAX_SHARDS, 8))
    with pytest.raises(ValueError, match="at most 1026"):
        PeerRecord.parse_obj(_peer_record(MAX_SHARDS + 1, 8))
    shards = {str(i): "f" * 64 for i in range(MAX_SHARDS + 1)}
    with pytest.raises(ValueError, match="at most 1026"):
        AnnounceRecord.parse_obj({"round": 1, "shards": shards, "tokens": 1, "steps": 1})


@pytest.mark.parametrize("config", ["tiny", "small", "178m", "1b"])
def test_real_records_fit_their_caps_with_room(config):
    loaded = load_config(CONFIGS / f"{config}.toml")
    n_shards = loaded.model.n_layers + 2
    peer = len(MSGPackSerializer.dumps(_peer_record(n_shards, stages=loaded.pipeline.stages)))
    announce = {
        "round": 10**6,
        "shards": {str(i): "f" * 64 for i in range(n_shards)},
        "tokens": 1,
        "steps": 1,
    }
    assert peer < MAX_RECORD_BYTES["peers"] / 3
    assert len(MSGPackSerializer.dumps(announce)) < MAX_RECORD_BYTES["announce"] / 2


def test_callers_ttls_stay_under_the_caps():
    from bootstrap.coordinator import MANIFEST_TTL_S
    from hetnode.daemon.seal_wait import ANNOUNCE_TTL_S
    from hetnode.protocol.sealing import SEAL_TTL_S

    for field, ttl_s in {"seal": SEAL_TTL_S, "announce": ANNOUNCE_TTL_S, "manifest": MANIFEST_TTL_S}.items():
        assert ttl_s <= MAX_TTL_S[field], field
    for path in CONFIGS.glob("*.toml"):
        network = load_config(path).network
        assert network.record_ttl_s <= MAX_TTL_S["peers"], path.name
        assert network.boundary_s * 4 <= MAX_TTL_S["round"], path.name  # the coordinator's round TTL


# --- state cache ---------------------------------------------------------------------------------------


def test_state_is_encoded_once_per_round_and_shard_off_the_loop():
    calls: list[tuple[int, str]] = []
    loop_thread = threading.get_ident()
    threads: set[int] = set()

    def provider(round_: int, shard: str) -> bytes | None:
        calls.append((round_, shard))
        threads.add(threading.get_ident())
        time.sleep(0.05)
        return f"{round_}:{shard}".encode() if round_ >= 5 else None

    async def scenario():
        cache = StateCache(provider)
        got = await asyncio.gather(*[cache.get(5, "embed") for _ in range(8)])
        assert got == [b"5:embed"] * 8 and calls == [(5, "embed")]
        assert await cache.get(5, "embed") == b"5:embed" and len(calls) == 1
        assert await cache.get(4, "embed") is None and await cache.get(4, "embed") is None
        assert len(calls) == 3  # None is never kept: the round may become available later
        await cache.get(6, "0")  # a newer round evicts the older one
        await cache.get(5, "embed")
        assert calls[-1] == (5, "embed") and cache.encodings == 5
        assert await cache.get(6, "0") == b"6:0" and cache.encodings == 5  # round 5 answered, not kept
        cache.clear()

    asyncio.run(scenario())
    assert loop_thread not in threads


def test_state_cache_forgets_after_keep_s():
    async def scenario():
        cache = StateCache(lambda round_, shard: b"x", keep_s=0.05)
        await cache.get(1, "a")
        await cache.get(1, "a")
        assert cache.encodings == 1
        await asyncio.sleep(0.1)
        await cache.get(1, "a")
        assert cache.encodings == 2
        cache.clear()

    asyncio.run(scenario())


def test_slots_kept_for_preferred_peers_are_not_taken_by_others():
    scope = StreamScope(per_peer=4, total=4, preferred=2)
    assert scope.reserve("a") and scope.reserve("b")
    assert scope.reserve("c") is None  # strangers share the 2 other slots
    kept = scope.reserve("sealer", preferred=True)
    assert kept and scope.reserve("sealer", preferred=True)
    assert scope.reserve("sealer", preferred=True) is None  # the whole node is full
    kept.release()
    assert scope.reserve("c") is None and scope.reserve("sealer", preferred=True)
    with pytest.raises(ValueError, match="streams_preferred"):
        NodeBudgets(streams_global=8, streams_preferred=8)


def test_paced_fields_are_optional_and_strict_in_the_dhts_schema():
    """hivemind refuses a record its schema would change: a seal, contribution or announcement without the
    paced fields (a "steps" run) is stored as it is, and with them only when they are the right type."""
    from hivemind.dht.schema import SchemaValidator

    from hetnode.net.records import RunRecords, record_key

    identity = ephemeral_identity()
    validator = SchemaValidator(RunRecords, allow_extra_keys=False, prefix="run")

    def valid(field: str, value: dict) -> bool:
        key = DHTID.generate(source=record_key("run", field)).to_bytes()
        subkey = MSGPackSerializer.dumps(owner_subkey(identity))
        return validator.validate(DHTRecord(key, subkey, MSGPackSerializer.dumps(value), time.time() + 60))

    contribution = {"peer": "p", "shards": {"embed": "0" * 64}, "tokens": 1, "weight": 1}
    seal = {"round": 1, "contributions": [contribution], "excluded": [], "sealed_at": 1.0, "prev": ""}
    announce = {"round": 1, "shards": {"embed": "0" * 64}, "tokens": 1, "steps": 1}
    assert valid("seal", seal) and valid("announce", announce)
    paced = {**seal, "contributions": [{**contribution, "steps": 7}], "budget_s": 3.5}
    assert valid("seal", paced) and valid("announce", {**announce, "train_s": 2.25})
    assert not valid("seal", {**paced, "budget_s": 3})  # an int where a float belongs
    assert not valid("seal", {**paced, "budget_s": -1.0})
    assert not valid("announce", {**announce, "train_s": 1e9})
    peer = _peer_record(4)  # a replica sitting out says how long its floor of steps takes
    assert valid("peers", peer) and valid("peers", {k: v for k, v in peer.items() if k != "floor_s"})
    for bad in (0.0, -1.0, 1e9, float("nan"), float("inf"), 5):
        assert not valid("peers", {**peer, "floor_s": bad}), bad
