"""The coordinator's change log as pure steps: computed from two views, applied to a stale one, trimmed to
the entry's caps, checked by the schema; and stored before the head that names the new digest."""

import asyncio
import time
from types import SimpleNamespace

import pydantic.v1 as pydantic
import pytest

from hetnode.net.node import StoredValue
from hetnode.net.records import (
    MAX_CHANGE_STEPS,
    MAX_RECORD_BYTES,
    MAX_STEP_PEERS,
    check_changes_record,
    new_changes_record,
    new_peer_record,
    value_bytes,
)
from hetnode.protocol.swarm_view import SwarmView
from hetnode.protocol.view_changes import ChangeLog, apply_steps, new_step, step_chain, trim_steps

LINK = {"link_class": "low", "up_mbps": 20.0, "down_mbps": 20.0, "mem_gb": 1.0, "tflops": 0.5}


def record(name: str, role: str = "idle", **fields) -> dict:
    return new_peer_record(name, role=role, wants="stage", **LINK) | fields


def view_of(records: dict[str, dict]) -> SwarmView:
    entries = {peer: StoredValue(peer, value, time.time() + 60) for peer, value in records.items()}
    return SwarmView.from_entries(entries, stages_per_chain=2, n_layers=4)


BASE = {"QmA": record("a", "anchor"), "QmB": record("b"), "QmC": record("c")}


def test_a_step_holds_the_peers_whose_decision_fields_changed_and_applying_it_gives_the_new_view():
    before = view_of(BASE)
    after = view_of(
        {
            "QmA": BASE["QmA"] | {"params_round": 9, "tokens": 5},  # per-round fields only: not a change
            "QmB": BASE["QmB"] | {"role": "anchor", "wants": "anchor"},
            "QmD": record("d"),  # joined; C left
        }
    )
    step = new_step(before, after)
    assert step["from"] == before.digest() and step["to"] == after.digest()
    assert step["peers"] == {"QmB": after.peers["QmB"], "QmD": after.peers["QmD"], "QmC": None}
    moved = apply_steps(before, [step], after.digest())
    assert moved is not None and moved.digest() == after.digest() and set(moved.peers) == set(after.peers)
    assert moved.peers["QmA"] == before.peers["QmA"]  # the per-round fields stay as our last full read


def test_a_step_that_names_more_peers_than_allowed_is_not_logged():
    before = view_of({})
    after = view_of({f"Qm{i}": record(str(i)) for i in range(MAX_STEP_PEERS + 1)})
    assert new_step(before, after) is None
    assert new_step(before, after, max_peers=MAX_STEP_PEERS + 1) is not None


def chain_of(*digests: str) -> list[dict]:
    return [{"from": a, "to": b, "peers": {}} for a, b in zip(digests, digests[1:], strict=False)]


def test_the_chain_runs_from_our_digest_to_the_heads_through_consecutive_steps():
    steps = chain_of("a", "b", "c", "d")
    assert step_chain(steps, "b", "d") == steps[1:]
    assert step_chain(steps, "a", "b") == steps[:1]
    assert step_chain(steps, "x", "d") is None  # we missed more steps than are kept
    assert step_chain(steps, "c", "b") is None  # not forwards
    assert step_chain(steps[:1] + steps[2:], "a", "d") is None  # a gap
    back_and_forth = chain_of("a", "b", "a", "b")
    assert step_chain(back_and_forth, "a", "b") == back_and_forth[2:]  # the latest run


def test_applied_records_are_checked_as_a_full_read_checks_them():
    before = view_of(BASE)
    after = view_of(BASE | {"QmD": record("d")})
    step = new_step(before, after)
    target = after.digest()
    assert apply_steps(before, [step], target) is not None
    # a record our schema refuses, a non-member, a record of another model: the digest cannot match
    bad = [
        step | {"peers": {"QmD": step["peers"]["QmD"] | {"tflops": "fast"}}},
        step | {"peers": {"QmD": step["peers"]["QmD"] | {"layers": [0, 99]}}},
    ]
    for broken in bad:
        assert apply_steps(before, [broken], target) is None
    assert apply_steps(before, [step], target, is_member=lambda peer: peer != "QmD") is None
    # records that do not reproduce the digest the step claims (or the head names)
    assert apply_steps(before, [step | {"peers": {}}], target) is None
    assert apply_steps(before, [step], "0" * 16) is None
    # an offline record is a leave, as in a full read
    leave = {"from": before.digest(), "to": view_of({"QmA": BASE["QmA"], "QmB": BASE["QmB"]}).digest()}
    offline = leave | {"peers": {"QmC": BASE["QmC"] | {"role": "offline"}}}
    assert set(apply_steps(before, [offline], leave["to"]).peers) == {"QmA", "QmB"}


def test_the_log_keeps_its_newest_steps_within_the_entrys_byte_cap():
    def step(i: int, n: int) -> dict:
        fat = record("p", admission="x" * 1500)  # ~1.9 KB
        return {"from": f"{i:016x}", "to": f"{i + 1:016x}", "peers": {f"Qm{i}x{j}": fat for j in range(n)}}

    steps = [step(i, 1) for i in range(20)]
    assert trim_steps(steps) == steps[-MAX_CHANGE_STEPS:]
    heavy = [step(i, 16) for i in range(4)]  # ~30 KB each
    kept = trim_steps(heavy)
    assert kept == heavy[-len(kept) :] and 1 <= len(kept) < 4
    assert value_bytes(new_changes_record(kept)) <= MAX_RECORD_BYTES["changes"]
    assert trim_steps([step(0, 30)], max_bytes=1000) == []  # too large alone: not published


def test_the_schema_refuses_malformed_oversized_or_overlong_logs():
    peers = {"QmD": view_of({"QmD": record("d")}).peers["QmD"], "QmC": None}
    good = new_changes_record([{"from": "0" * 16, "to": "1" * 16, "peers": peers}])
    crowd = {f"Qm{i}": None for i in range(10_000)}  # refused on its length, before any item is checked
    assert check_changes_record(good) == good
    bad = [
        good | {"at": float("nan")},
        good | {"steps": [{"from": "x" * 16, "to": "1" * 16, "peers": {}}]},
        good | {"steps": [{"from": "0" * 16, "to": "1" * 16, "peers": {"not/a/peer": None}}]},
        good | {"steps": [{"from": "0" * 16, "to": "1" * 16, "peers": {"QmD": {"role": "anchor"}}}]},
        good | {"steps": chain_of(*(f"{i:016x}" for i in range(MAX_CHANGE_STEPS + 2)))},
        good | {"steps": [{"from": "0" * 16, "to": "1" * 16, "peers": crowd}]},
    ]
    for value in bad:
        with pytest.raises(pydantic.ValidationError):
            check_changes_record(value)


def test_the_coordinator_stores_the_step_before_the_head_that_names_its_digest():
    from bootstrap.round_keeper import RoundKeeper

    stored: list[tuple[str, dict]] = []

    async def store_own(field, value, ttl_s):
        stored.append((field, value))
        return True

    node = SimpleNamespace(store_own=store_own)
    before, after = view_of(BASE), view_of(BASE | {"QmD": record("d")})
    keeper = SimpleNamespace(
        node=node,
        view=SimpleNamespace(digest=after.digest()),
        changes=ChangeLog(node, 60.0),
        _sealed=-1,
        _head=None,
        _directory_changed=asyncio.Event(),
    )
    keeper.changes.record(None, before)  # the first read: nothing to log
    RoundKeeper.directory_changed(keeper, before, after)
    asyncio.run(RoundKeeper._store_head(keeper, 3, {}))
    assert [field for field, _ in stored] == ["changes", "head"]
    assert stored[0][1]["steps"][-1]["to"] == stored[1][1]["directory"] == after.digest()
    asyncio.run(RoundKeeper._store_head(keeper, 3, {}))  # nothing new: only the head
    assert [field for field, _ in stored] == ["changes", "head", "head"]
