"""A control plane that stays small: heartbeats and record reads stretch while nothing changes and come
back at once when something does, over real p2pd nodes on loopback."""

import asyncio
import logging
import time
from collections.abc import Callable

import pydantic.v1 as pydantic
import pytest

from hetnode.daemon.participant import RoundParticipant
from hetnode.daemon.seal_wait import read_head
from hetnode.net import loop
from hetnode.net.node import StoredValue
from hetnode.net.records import MAX_TTL_S, new_head_record, new_peer_record
from hetnode.protocol.view import PeerDirectory
from hetnode.replica.global_model import GlobalModel
from hetnode.service.presence import STABLE_STEPS, Cadence, Presence

LINK = {"link_class": "low", "up_mbps": 20.0, "down_mbps": 20.0, "mem_gb": 1.0, "tflops": 0.5}


def record(name: str, role: str = "idle") -> dict:
    return new_peer_record(name, role=role, wants="stage", **LINK)


def test_a_cadence_doubles_while_nothing_changes_up_to_its_stable_period_and_resets_on_a_change():
    cadence = Cadence(1.0, 6.0)
    periods = []
    for _ in range(4 * STABLE_STEPS):
        periods.append(cadence.period_s)
        cadence.observe(changed=False)
    assert periods == [p for p in (1.0, 2.0, 4.0, 6.0) for _ in range(STABLE_STEPS)]
    cadence.observe(changed=True)
    assert cadence.period_s == 1.0


def gaps_of(times: list[float]) -> list[float]:
    return [b - a for a, b in zip(times, times[1:], strict=False)]


class Counting:
    """Counts a real node's DHT stores and reads (the calls go through unchanged)."""

    def __init__(self, node, *methods: str) -> None:
        self.times: dict[str, list[float]] = {m: [] for m in methods}
        self.fields: list[str] = []  # the record fields stored or read, in order
        for method in methods:
            original = getattr(node, method)

            async def counted(*args, _original=original, _method=method, **kwargs):
                self.times[_method].append(time.monotonic())
                self.fields.append(args[0] if args else kwargs.get("field"))
                return await _original(*args, **kwargs)

            setattr(node, method, counted)


@pytest.mark.slow
def test_a_stable_record_heartbeats_less_often_lives_longer_and_a_role_change_still_lands(nodes_on_loopback):
    async def scenario():
        async with nodes_on_loopback(2, "presence-test") as (reader, peer):
            stores = Counting(peer, "store_own")
            presence = Presence(peer, record("p"), heartbeat_s=0.2, ttl_s=0.6, stable_heartbeat_s=0.8)
            stop = asyncio.Event()
            beating = asyncio.create_task(presence.heartbeat(stop))
            await asyncio.sleep(4.0)
            gaps = gaps_of(stores.times["store_own"])
            assert gaps[0] < 0.4 and min(gaps[-2:]) > 0.7  # from the base heartbeat to the stable one
            assert presence.heartbeat_s == 0.8
            entry = (await reader.read_field("peers"))[peer.identity.peer_id]
            assert entry.expiration - time.time() > 1.0  # lives 3 stable heartbeats, not 0.6 s

            # a role change stores a record that expires sooner than the stored one: it must still land
            assert await presence.update(role="anchor", wants="anchor")
            assert (await reader.read_field("peers"))[peer.identity.peer_id].value["role"] == "anchor"
            assert presence.heartbeat_s == 0.2  # and the heartbeat is back at its base
            before = len(stores.times["store_own"])
            await asyncio.sleep(0.5)
            assert len(stores.times["store_own"]) - before >= 2
            stop.set()
            await beating

    loop.run(scenario())


@pytest.mark.slow
def test_a_stretched_record_never_outlives_the_fields_cap_and_is_still_stored(nodes_on_loopback):
    """`small`'s settings (30 s records at a 10 s heartbeat, 60 s once stable) stretch a record to 180 s,
    past the 120 s every DHT node allows: without the cap, every store of a stable swarm was refused."""

    async def scenario():
        async with nodes_on_loopback(2, "presence-cap") as (reader, peer):
            presence = Presence(peer, record("p"), heartbeat_s=10.0, ttl_s=30.0, stable_heartbeat_s=60.0)
            assert await presence.publish()
            for _ in range(3 * 4):  # stable long enough for the 60 s heartbeat
                presence.cadence.observe(changed=False)
            assert presence.heartbeat_s == 60.0
            assert await presence.publish(), "a stable record must still be stored"
            entry = (await reader.read_field("peers"))[peer.identity.peer_id]
            assert 60.0 < entry.expiration - time.time() <= MAX_TTL_S["peers"] + 1.0

    loop.run(scenario())


def test_a_record_the_dht_hides_comes_straight_from_its_peer_when_it_speaks_to_us(
    nodes_on_loopback, tiny_config
):
    """Nodes next to the `peers` key that keep nothing hide a replica's record (docs/security.md, "Exhaust a
    daemon"): when the replica nudges the coordinator, the coordinator's directory takes the record from it
    and the replica is in its
    view (so its seal waits for it); a malformed record is refused."""

    async def scenario():
        async with nodes_on_loopback(3, "hidden-record") as (me, hidden, liar):
            for node, value in ((hidden, record("hidden", "anchor")), (liar, {"name": 5})):
                node._own["peers"] = (value, time.time() + 60)  # served directly, never stored in the DHT
            directory = PeerDirectory(me, tiny_config, base_s=0.2, stable_s=0.8)
            assert hidden.identity.peer_id not in (await directory.get()).peers
            directory.heard_from(hidden.identity.peer_id)
            directory.heard_from(liar.identity.peer_id)
            for _ in range(50):
                if hidden.identity.peer_id in (await directory.get()).peers:
                    break
                await asyncio.sleep(0.1)
            view = await directory.get(max_age_s=0)  # a full read keeps the record taken directly
            assert view.peers[hidden.identity.peer_id]["role"] == "anchor"
            assert view.expected_contributors(1) == {hidden.identity.peer_id}
            assert liar.identity.peer_id not in view.peers
            # until it expires (the peer refreshes it each time it speaks to us)
            taken, entry = directory._direct[hidden.identity.peer_id]
            directory._direct[hidden.identity.peer_id] = (taken, StoredValue(entry.peer_id, entry.value, 1.0))
            assert hidden.identity.peer_id not in (await directory.get(max_age_s=0)).peers

    loop.run(scenario())


@pytest.mark.slow
def test_one_read_serves_every_caller_and_reads_stretch_until_the_swarm_changes(
    nodes_on_loopback, tiny_config
):
    async def scenario():
        async with nodes_on_loopback(3, "directory-test") as (me, other, newcomer):
            await other.store_own("peers", record("other", "anchor"), ttl_s=60)
            reads = Counting(me, "read_field")
            directory = PeerDirectory(me, tiny_config, base_s=0.2, stable_s=0.8)
            views = await asyncio.gather(*(directory.get() for _ in range(10)))
            assert len(reads.times["read_field"]) == 1 and all(v is views[0] for v in views)

            stop = asyncio.Event()
            following = asyncio.create_task(directory.follow(stop))
            await asyncio.sleep(3.0)
            stable_gaps = gaps_of(reads.times["read_field"])
            # a gap is the period plus the read itself (a tenth of a second or two on a loaded CI machine)
            assert stable_gaps[0] < 0.6 and stable_gaps[-1] > 0.7
            assert directory.cadence.period_s == 0.8

            # a newcomer's record is a change: the reads are back at their base
            await newcomer.store_own("peers", record("newcomer"), ttl_s=60)
            await asyncio.sleep(1.2)
            assert newcomer.identity.peer_id in (await directory.get()).peers
            assert directory.cadence.period_s < 0.8

            # a stranger's request wakes the reads at once (never faster than the base)
            for _ in range(3 * 4):
                directory.cadence.observe(changed=False)
            count = len(reads.times["read_field"])
            while len(reads.times["read_field"]) == count:  # the loop's next read: then it sleeps 0.8 s
                await asyncio.sleep(0.01)
            await asyncio.sleep(0.3)  # past the base: a woken read is not refused as too soon
            count = len(reads.times["read_field"])
            directory.wake()
            await asyncio.sleep(0.15)
            assert len(reads.times["read_field"]) == count + 1
            stop.set()
            await following

    loop.run(scenario())


@pytest.mark.slow
def test_a_store_no_node_accepted_is_retried_soon_and_does_not_stretch_the_heartbeat(nodes_on_loopback):
    async def scenario():
        async with nodes_on_loopback(2, "presence-retry") as (reader, peer):
            real_store = peer.store_own
            attempts: list[tuple[float, bool]] = []
            refusals = {"left": 0}

            async def store_once_refused(*args, **kwargs):
                if refusals["left"]:  # as when every DHT node it reached refused or timed out
                    refusals["left"] -= 1
                    attempts.append((time.monotonic(), False))
                    return False
                attempts.append((time.monotonic(), True))
                return await real_store(*args, **kwargs)

            peer.store_own = store_once_refused
            presence = Presence(peer, record("p"), heartbeat_s=1.0, ttl_s=3.0, stable_heartbeat_s=30.0)
            stop = asyncio.Event()
            beating = asyncio.create_task(presence.heartbeat(stop))
            # once the first store is done, the heartbeat sleeps its base period (set before a slow store
            # ended, the stretch would already apply to that first sleep, and nothing come for 30 s)
            deadline = time.monotonic() + 10
            while not presence.stored and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
            assert presence.stored, attempts
            presence.cadence.unchanged = 100  # a long-stable swarm: the heartbeat is stretched to 30 s
            refusals["left"] = 1  # and the next store is refused
            deadline = time.monotonic() + 10
            while len(attempts) < 3 and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
            stop.set()
            await beating
            assert [ok for _, ok in attempts[:3]] == [True, False, True]
            assert attempts[2][0] - attempts[1][0] < 3.0  # retried within RETRY_S, not 30 s later
            assert presence.heartbeat_s == 30.0  # the refusal did not reset or stretch the cadence
            assert presence.stored
            assert peer.identity.peer_id in await reader.read_field("peers")

    loop.run(scenario())


@pytest.mark.slow
def test_the_digest_check_after_a_round_reads_the_coordinators_head_not_the_peer_records(
    nodes_on_loopback, tiny_config, tmp_path, caplog
):
    """The check every replica runs after every round costs one small entry, not a read of the swarm's
    records; only the coordinator's head counts (an impostor's, under its own key, is not its), and a
    malformed head is refused where it is stored."""

    async def scenario():
        async with nodes_on_loopback(3, "head-test") as (coordinator, replica, impostor):
            model = GlobalModel(tiny_config)
            model.params_round = 3
            ours = model.digests()
            participant = RoundParticipant(
                tiny_config, replica, coordinator.identity.peer_id, model, False, tmp_path
            )
            reads = Counting(replica, "read_field")
            stop = asyncio.Event()
            stop.set()  # a mismatch would download θ: here it only has to be noticed

            other = {shard: "0" * 16 for shard in ours}
            assert await impostor.store_own("head", new_head_record(3, other, None), ttl_s=60)
            assert await coordinator.store_own("head", new_head_record(3, ours, None), ttl_s=60)
            participant.unchecked = 3
            with caplog.at_level(logging.WARNING, logger="hetnode.daemon.participant"):
                assert await participant.verify_agreement(stop) is False
                assert participant.unchecked is None  # checked, and they agree
                assert "differ" not in caplog.text
                assert reads.fields == ["head"], reads.fields  # no read of the peer records

                # a coordinator whose θ differs in one shard: noticed
                differs = dict(ours, embed="f" * 16)
                assert await coordinator.store_own("head", new_head_record(3, differs, None), ttl_s=60)
                participant.unchecked = 3
                await participant.verify_agreement(stop)
                assert "layer digests differ from the coordinator's in ['embed']" in caplog.text

            for bad in ({"round": "3", "layer_digests": ours}, {"round": 3, "layer_digests": {"x": "00"}}):
                assert not await impostor.store_own("head", bad, ttl_s=60)
            assert await read_head(replica, impostor.identity.peer_id) == (3, other)

    loop.run(scenario())


def test_a_head_entry_our_schema_refuses_is_not_taken_for_the_coordinators_digests():
    from hetnode.net.records import check_head_record

    assert check_head_record({"round": 3, "layer_digests": {"embed": "0" * 16}})["round"] == 3
    bad_heads = [{"round": "3", "layer_digests": {}}, {"round": 3}, {"round": 3, "layer_digests": {"x": "0"}}]
    good = {"round": 3, "layer_digests": {}, "directory": "0" * 16, "at": 1.7e9}
    assert check_head_record(good)["directory"] == "0" * 16
    bad_heads += [good | {"at": float("nan")}, good | {"at": 1e300}, good | {"directory": "x" * 16}]
    for bad in bad_heads:
        with pytest.raises(pydantic.ValidationError):
            check_head_record(bad)


@pytest.mark.slow
def test_a_replica_reads_every_record_only_when_the_coordinators_view_differs_from_its_own(
    nodes_on_loopback, tiny_config
):
    """In a stable swarm a refresh of the peer records costs one small `head` entry: the coordinator's
    digest of its view equals ours. A change (a newcomer) changes the coordinator's digest and brings a full
    read; a head stored too long ago, an impostor's head, a wake and `max_age_s=0` never vouch."""
    from hetnode.protocol.view import coordinator_directory

    async def scenario():
        async with nodes_on_loopback(4, "vouched-test") as (coordinator, me, newcomer, impostor):
            coordinator_id = coordinator.identity.peer_id
            for node, name, role in ((coordinator, "coord", "coordinator"), (me, "me", "anchor")):
                await node.store_own("peers", record(name, role), ttl_s=60)
            theirs = PeerDirectory(coordinator, tiny_config, base_s=0.1, stable_s=0.1)

            async def publish_head(at_offset_s: float = 0.0) -> None:
                head = new_head_record(3, {}, (await theirs.get(max_age_s=0)).digest())
                head["at"] += at_offset_s
                assert await coordinator.store_own("head", head, ttl_s=60)

            fresh_s = 5.0
            directory = PeerDirectory(
                me,
                tiny_config,
                base_s=0.1,
                stable_s=0.1,
                vouched=lambda: coordinator_directory(me, coordinator_id, fresh_s),
            )
            reads = Counting(me, "read_field")
            await publish_head()
            first = await directory.get()
            assert directory.reads == 1 and set(first.peers) == {coordinator_id, me.identity.peer_id}
            for _ in range(5):
                await asyncio.sleep(0.15)
                assert await directory.get() is first
            assert directory.reads == 1 and directory.vouched_refreshes == 5
            assert reads.fields == ["peers"] + ["head"] * 5, reads.fields

            # an impostor's head, under its own key, says nothing about the coordinator's view
            assert await impostor.store_own("head", new_head_record(3, {}, "0" * 16), ttl_s=60)
            # a newcomer: the coordinator's view and digest change, ours is stale, so we read every record
            await newcomer.store_own("peers", record("newcomer"), ttl_s=60)
            await publish_head()
            await asyncio.sleep(0.15)
            view = await directory.get()
            assert newcomer.identity.peer_id in view.peers and directory.reads == 2
            await asyncio.sleep(0.15)
            await directory.get()
            assert directory.reads == 2  # and the equal digests vouch again

            # a head from a coordinator that stopped storing it (its clock fresh_s ago): no vouching
            await publish_head(at_offset_s=-2 * fresh_s)
            await asyncio.sleep(0.15)
            await directory.get()
            assert directory.reads == 3
            await publish_head()

            # a wake (a stranger's request) and a read that must be current always read every record
            await asyncio.sleep(0.15)
            directory.wake()
            await directory.get()
            assert directory.reads == 4
            await directory.get(max_age_s=0)
            assert directory.reads == 5
            await asyncio.sleep(0.15)
            await directory.get()
            assert directory.reads == 5  # vouched again

    loop.run(scenario())


def test_a_views_digest_follows_roles_and_links_not_per_round_fields(tiny_config):
    from hetnode.net.node import StoredValue
    from hetnode.protocol.swarm_view import SwarmView

    def view_of(**changes) -> SwarmView:
        rec = record("p", "anchor") | changes
        return SwarmView.from_entries(
            {"peer-a": StoredValue("peer-a", rec, 0.0)}, 2, tiny_config.model.n_layers
        )

    base = view_of().digest()
    assert len(base) == 16 and view_of(params_round=7, tokens=99, last_seen=5.0).digest() == base
    assert view_of(role="idle").digest() != base
    assert view_of(tflops=9.0).digest() != base
    assert SwarmView({}, 2, 4).digest() != base


async def _coordinator_and_replica(tiny_config, coordinator, me, fresh_s: float, **hooks):
    """The coordinator's directory with its change log (as `RoundKeeper` wires them), and a replica's
    directory vouched by the coordinator's head and fed by its change log."""
    from hetnode.protocol.view import coordinator_directory
    from hetnode.protocol.view_changes import ChangeLog, coordinator_changes

    coordinator_id = coordinator.identity.peer_id
    for node, name, role in ((coordinator, "coord", "coordinator"), (me, "me", "anchor")):
        await node.store_own("peers", record(name, role), ttl_s=60)
    log = ChangeLog(coordinator, ttl_s=60.0)
    theirs = PeerDirectory(coordinator, tiny_config, base_s=0.1, stable_s=0.1, on_change=log.record)
    ours = PeerDirectory(
        me,
        tiny_config,
        base_s=0.1,
        stable_s=0.1,
        vouched=lambda: coordinator_directory(me, coordinator_id, fresh_s),
        changes=lambda: coordinator_changes(me, coordinator_id, fresh_s),
        **hooks,
    )
    return log, theirs, ours


@pytest.mark.slow
def test_a_vouched_replica_takes_a_join_and_a_leave_from_the_coordinators_change_log(
    nodes_on_loopback, tiny_config
):
    """A newcomer and a leaver reach a replica whose view was current through the coordinator's `changes`
    entry (the changed records only): no read of every record, and the view a full read gives."""
    from hetnode.protocol.swarm_view import SwarmView

    async def scenario():
        async with nodes_on_loopback(3, "changes-test") as (coordinator, me, newcomer):
            full_reads, changes = [], []
            log, theirs, directory = await _coordinator_and_replica(
                tiny_config,
                coordinator,
                me,
                5.0,
                on_read=full_reads.append,
                on_change=lambda before, after: changes.append(after.digest()),
            )

            async def coordinator_reads() -> str:
                digest = (await theirs.get(max_age_s=0)).digest()  # a change: its step is logged
                await log.publish()  # before the head names the digest, as `RoundKeeper._store_head`
                assert await coordinator.store_own("head", new_head_record(3, {}, digest), ttl_s=60)
                return digest

            await coordinator_reads()
            await directory.get()
            reads = Counting(me, "read_field")
            assert directory.reads == 1 and directory.delta_refreshes == 0

            views = []
            for change, present in (({"role": "idle"}, True), ({"role": "offline"}, False)):
                assert await newcomer.store_own("peers", record("newcomer") | change, ttl_s=60)
                digest = await coordinator_reads()
                await asyncio.sleep(0.15)
                view = await directory.get()
                views.append(view)
                assert (newcomer.identity.peer_id in view.peers) is present
                assert directory.reads == 1 and directory.digest == view.digest() == digest
                full = await SwarmView.read(me, tiny_config)
                assert full.digest() == digest and set(full.peers) == set(view.peers)
                assert all(view.row(peer) == full.row(peer) for peer in full.peers)
            assert directory.delta_refreshes == 2 and len(full_reads) == 1  # `on_read`: full reads only
            assert changes[1:] == [view.digest() for view in views]  # `on_change`: each applied change
            assert reads.fields == ["head", "changes", "peers"] * 2, reads.fields  # the peers: our checks

    loop.run(scenario())


@pytest.mark.slow
def test_a_change_log_that_is_too_short_an_impostors_wrong_or_stale_brings_a_full_read(
    nodes_on_loopback, tiny_config
):
    """Anything but a fresh coordinator log that leads from our digest to the head's is no shortcut: a
    replica that missed more steps than are kept, a log under an impostor's key, steps whose records do
    not give the head's digest, a log stored too long ago. Each costs a full read, never a wrong view."""
    from hetnode.net.records import MAX_CHANGE_STEPS, new_changes_record

    fresh_s = 5.0

    async def scenario():
        async with nodes_on_loopback(4, "changes-refused") as (coordinator, me, newcomer, impostor):
            log, theirs, directory = await _coordinator_and_replica(tiny_config, coordinator, me, fresh_s)
            tflops = iter(range(1, 100))

            async def change(forge: Callable[[list[dict]], dict] | None = None) -> str:
                """The newcomer changes its compute; the coordinator reads it (and logs the step), stores
                its log, or `forge(its steps)` instead, then the head."""
                compute = {"tflops": float(next(tflops))}
                assert await newcomer.store_own("peers", record("newcomer") | compute, ttl_s=60)
                digest = (await theirs.get(max_age_s=0)).digest()
                if forge is None:
                    await log.publish()
                else:
                    assert await coordinator.store_own("changes", forge(log.steps), ttl_s=60)
                assert await coordinator.store_own("head", new_head_record(3, {}, digest), ttl_s=60)
                return digest

            async def refresh(digest: str, full_read: bool) -> None:
                reads, deltas = directory.reads, directory.delta_refreshes
                await asyncio.sleep(0.15)
                assert (await directory.get()).digest() == digest == directory.digest
                assert (directory.reads, directory.delta_refreshes) == (
                    (reads + 1, deltas) if full_read else (reads, deltas + 1)
                )

            await refresh(await change(), full_read=True)  # our first read
            await refresh(await change(), full_read=False)  # one behind: the log's last step

            # we missed more changes than the log keeps: no step starts from our digest
            ours = directory.digest
            for _ in range(MAX_CHANGE_STEPS + 1):
                digest = await change()
            assert len(log.steps) == MAX_CHANGE_STEPS and all(s["from"] != ours for s in log.steps)
            await refresh(digest, full_read=True)

            # the right steps, but under an impostor's key (the coordinator's own log is empty)
            digest = await change(lambda steps: new_changes_record([]))
            assert await impostor.store_own("changes", new_changes_record(log.steps), ttl_s=60)
            await refresh(digest, full_read=True)

            # the coordinator's steps, with a record that does not give the head's digest
            def forged(steps: list[dict]) -> dict:
                peers = {peer: r and r | {"tflops": 0.25} for peer, r in steps[-1]["peers"].items()}
                return new_changes_record([*steps[:-1], steps[-1] | {"peers": peers}])

            await refresh(await change(forged), full_read=True)

            # the right steps, stored by the coordinator's clock longer ago than the head's freshness
            await refresh(
                await change(lambda steps: new_changes_record(steps) | {"at": time.time() - 2 * fresh_s}),
                full_read=True,
            )

            # and its own fresh log again: the shortcut is back
            await refresh(await change(), full_read=False)

    loop.run(scenario())
