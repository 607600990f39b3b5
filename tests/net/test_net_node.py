"""The net layer on real p2pd daemons over loopback: signed records, hostile frames, the probe, rate limits.

Every scenario runs on the daemon's own event loop and shuts its nodes down in `finally`, so no p2pd
outlives a test (and `p2pd` dies with this process in any case: PR_SET_PDEATHSIG).
"""

import asyncio
import contextlib
import os
import struct
import time

import pytest
from hivemind.dht.node import DHTNode
from hivemind.p2p import PeerID

from hetnode.net import loop
from hetnode.net.identity import ephemeral_identity, load_or_create_identity, owner_subkey, peer_id_of_subkey
from hetnode.net.node import CONTROL_HANDLER, NodeLimits, SwarmNode
from hetnode.net.records import new_peer_record, record_key
from hetnode.net.streams import PeerRequestError, RateLimiter, read_frame
from hetnode.service.presence import keep_in_dht
from hetnode.wire.control import decode_reply, frame_header

LOOPBACK = ["/ip4/127.0.0.1/tcp/0"]
LIMITS = NodeLimits(probe_bytes=4 * 2**20, probe_s=3.0, requests_per_min=600)
RUN = "testrun"


def peer_record(name="p", role="idle", **changes):
    link = {"link_class": "low", "up_mbps": 20.0, "down_mbps": 20.0, "mem_gb": 1.0, "tflops": 0.5}
    return new_peer_record(name, role=role, wants="stage", **link) | changes


@contextlib.asynccontextmanager
async def swarm(count, limits=LIMITS):
    """`count` nodes with distinct keys, each on the first one's DHT; all shut down on exit."""
    nodes = []
    try:
        first = await SwarmNode.start(ephemeral_identity(), limits, LOOPBACK)
        nodes.append(first)
        await first.join_dht(RUN, [])
        maddrs = await first.visible_maddrs()
        for _ in range(count - 1):
            node = await SwarmNode.start(ephemeral_identity(), limits, LOOPBACK, initial_peers=maddrs)
            nodes.append(node)
            await node.join_dht(RUN, maddrs)
        yield nodes
    finally:
        for node in reversed(nodes):
            await node.shutdown()


def test_identity_is_persistent_and_matches_libp2p(tmp_path):
    first = load_or_create_identity(tmp_path / "id.key")
    again = load_or_create_identity(tmp_path / "id.key")
    assert first.peer_id == again.peer_id
    assert first.peer_id == PeerID.from_identity((tmp_path / "id.key").read_bytes()).to_base58()
    assert peer_id_of_subkey(owner_subkey(first)) == first.peer_id
    assert peer_id_of_subkey(b"[owner:not a key]") is None
    assert oct((tmp_path / "id.key").stat().st_mode & 0o777) == "0o400"


def test_p2p_identity_is_the_record_signer(tmp_path):
    async def scenario():
        identity = load_or_create_identity(tmp_path / "id.key")
        node = await SwarmNode.start(identity, LIMITS, LOOPBACK)
        try:
            assert node.p2p.peer_id.to_base58() == identity.peer_id
        finally:
            await node.shutdown()

    loop.run(scenario())


def test_own_records_are_stored_and_read_by_signer():
    async def scenario():
        async with swarm(3) as (a, b, c):
            assert await b.store_own("peers", peer_record("b"), ttl_s=30)
            assert await c.store_own("peers", peer_record("c", role="anchor", wants="anchor"), ttl_s=30)
            seen = await a.read_field("peers")
            assert set(seen) == {b.identity.peer_id, c.identity.peer_id}
            assert seen[c.identity.peer_id].value["role"] == "anchor"

    loop.run(scenario())


def test_schema_violations_are_rejected():
    async def scenario():
        async with swarm(2) as (a, b):
            assert not await b.store_own("peers", peer_record(role="emperor"), ttl_s=30)
            assert not await b.store_own("peers", peer_record(up_mbps=20), ttl_s=30)  # int, not float
            assert not await b.store_own("peers", dict(peer_record(), admin=True), ttl_s=30)
            assert not await b.store_own("peers", peer_record(name="x" * 500), ttl_s=30)
            assert await a.read_field("peers") == {}

    loop.run(scenario())


def test_a_record_forged_for_another_peers_subkey_is_rejected():
    """An attacker with a DHT node that skips validation stores a record under the victim's subkey."""

    async def scenario():
        async with swarm(2) as (honest, victim):
            maddrs = await honest.visible_maddrs()
            attacker = await DHTNode.create(initial_peers=maddrs, host_maddrs=LOOPBACK)  # no validators
            try:
                forged = peer_record("victim", role="anchor", wants="anchor")
                subkey = owner_subkey(victim.identity)
                await attacker.store(record_key(RUN, "peers"), forged, time.time() + 30, subkey=subkey)
                # also a record signed by nobody for a subkey without an owner marker
                await attacker.store(record_key(RUN, "peers"), forged, time.time() + 30, subkey=b"plain")
                assert await honest.read_field("peers") == {}
                assert await victim.read_field("peers") == {}
            finally:
                await attacker.shutdown()

    loop.run(scenario())


def test_records_expire_when_the_peer_stops_refreshing():
    async def scenario():
        async with swarm(2) as (a, b):
            assert await b.store_own("peers", peer_record("b"), ttl_s=1.5)
            assert b.identity.peer_id in await a.read_field("peers")
            await asyncio.sleep(2.0)
            assert b.identity.peer_id not in await a.read_field("peers")

    loop.run(scenario())


async def _raw_exchange(client: SwarmNode, server: SwarmNode, data: bytes) -> bytes:
    _, reader, writer = await client.p2p.call_binary_stream_handler(server.p2p.peer_id, CONTROL_HANDLER)
    try:
        writer.write(data)
        await writer.drain()
        return await read_frame(reader, 2**16, timeout=15.0)
    finally:
        writer.close()


@pytest.mark.parametrize(
    "data",
    [
        pytest.param(os.urandom(256), id="random-bytes"),
        pytest.param(struct.pack(">I", 2**30) + b"x" * 64, id="oversized-frame"),
        pytest.param(frame_header(5) + b"\xc1\xc1\xc1\xc1\xc1", id="not-msgpack"),
        pytest.param(frame_header(100) + b"short", id="truncated"),
    ],
)
def test_hostile_frames_get_an_error_and_the_daemon_still_answers(data):
    async def scenario():
        async with swarm(2) as (server, client):
            reply = decode_reply(await _raw_exchange(client, server, data))
            assert reply.type == "error"
            assert reply["code"] in {"bad_request", "incomplete"}
            assert await client.ping(server.identity.peer_id) > 0  # still serving

    loop.run(scenario())


def test_probe_over_loopback_is_fast_and_bounded():
    async def scenario():
        async with swarm(2) as (server, client):
            started = time.monotonic()
            link = await client.measure_link(server.identity.peer_id)
            assert link.up_mbps > 100 and link.down_mbps > 100  # loopback moves >100 MB/s here
            assert 0 < link.rtt_ms < 1000
            assert time.monotonic() - started < 2 * LIMITS.probe_s + 5

    loop.run(scenario())


def test_rate_limit_per_peer_refuses_then_recovers():
    async def scenario():
        async with swarm(2, limits=NodeLimits(4 * 2**20, 3.0, requests_per_min=3)) as (server, client):
            for _ in range(3):
                await client.ping(server.identity.peer_id)
            with pytest.raises(PeerRequestError, match="rate_limited"):
                await client.ping(server.identity.peer_id)

    loop.run(scenario())


def test_rate_limiter_refills_with_time():
    now = [0.0]
    limiter = RateLimiter(per_minute=2, clock=lambda: now[0])
    assert limiter.allow("a") and limiter.allow("a") and not limiter.allow("a")
    assert limiter.allow("b")  # per peer
    now[0] += 30.0
    assert limiter.allow("a") and not limiter.allow("a")


def test_a_nudge_reaches_the_handler_and_a_dead_peer_costs_nothing():
    async def scenario():
        async with swarm(2) as (a, b):
            heard: asyncio.Queue = asyncio.Queue()
            b.set_nudge_handler(lambda peer, topic, round_: heard.put_nowait((peer, topic, round_)))
            gone = ephemeral_identity().peer_id  # nobody listens for this one
            a.nudge([b.identity.peer_id, gone, a.identity.peer_id], "seal", 4)  # returns at once
            assert await asyncio.wait_for(heard.get(), 10) == (a.identity.peer_id, "seal", 4)
            assert heard.empty()  # not sent to ourselves

    loop.run(scenario())


def test_sleep_or_wake_returns_on_the_first_of_wake_stop_or_timeout():
    from hetnode.service.lifecycle import sleep_or_wake

    async def scenario():
        stop, wake = asyncio.Event(), asyncio.Event()
        started = time.monotonic()
        wake.set()
        assert await sleep_or_wake(stop, wake, 30) is False and not wake.is_set()
        assert await sleep_or_wake(stop, wake, 0.05) is False
        stop.set()
        assert await sleep_or_wake(stop, wake, 30) is True
        assert time.monotonic() - started < 10

    loop.run(scenario())


def test_many_payloads_come_over_one_pipelined_stream_and_a_missing_one_fails_the_fetch():
    from hetnode.net.node import MAX_PAYLOADS_PER_STREAM

    # more than one stream's worth, some large: replies must flow while requests are still going out
    sizes = {f"s{i}": (3 * 2**20 if i % 97 == 0 else 200 + i) for i in range(MAX_PAYLOADS_PER_STREAM + 5)}
    held = {(5, shard, "r"): os.urandom(size) for shard, size in sizes.items()}

    async def scenario():
        async with swarm(2, limits=NodeLimits(4 * 2**20, 3.0, requests_per_min=3)) as (server, client):
            server.set_payloads(lambda round_, shard, replica, asker: held.get((round_, shard, replica)))
            peer = server.identity.peer_id
            wanted = [(shard, "r") for shard in sizes]
            got = await client.fetch_payloads(peer, 5, wanted, max_bytes=4 * 2**20)
            assert got == [held[(5, shard, "r")] for shard in sizes]  # every one, in the asked order
            assert client.traffic["received", "sync"] == sum(sizes.values())
            # two streams for 261 payloads, under a limit of 3 requests a minute: one more stream is left
            with pytest.raises(PeerRequestError, match="no payload for round 5 shard 'gone'"):
                await client.fetch_payloads(peer, 5, [("s1", "r"), ("gone", "r"), ("s2", "r")], 4 * 2**20)

    loop.run(scenario())


def test_only_payload_requests_may_follow_a_payload_request():
    from hetnode.wire.control import encode_request

    async def scenario():
        async with swarm(2) as (server, client):
            server.set_payloads(lambda round_, shard, replica, asker: b"x" * 10)
            requests = encode_request("payload", round=1, shard="a", replica="r")
            requests = frame_header(len(requests)) + requests
            probe = encode_request("probe_up", bytes=1024)
            _, reader, writer = await client.p2p.call_binary_stream_handler(
                server.p2p.peer_id, CONTROL_HANDLER
            )
            try:
                writer.write(requests + frame_header(len(probe)) + probe)
                await writer.drain()
                replies = [await read_frame(reader, 2**16, timeout=15.0) for _ in range(3)]
            finally:
                writer.close()
            # the payload is served, then the probe is refused with a reason
            assert decode_reply(replies[0]).type == "payload_ready" and replies[1] == b"x" * 10
            refusal = decode_reply(replies[2])
            assert refusal.type == "error" and "only payload requests" in refusal["message"]
            assert await client.ping(server.identity.peer_id) > 0

    loop.run(scenario())


def _isolate(node, others):
    """What a link down does to the DHT: every request `node` sends fails, so hivemind drops each of its
    neighbours from its table; the others' requests to it fail too, so they drop it."""
    table = node.dht.protocol.routing_table
    for node_id in list(table.uid_to_peer_id):
        del table[node_id]
    for other in others:
        theirs = other.dht.protocol.routing_table
        for node_id, peer in list(theirs.uid_to_peer_id.items()):
            if peer.to_base58() == node.identity.peer_id:
                del theirs[node_id]


def test_a_node_whose_routing_table_emptied_rejoins_through_its_contact_or_a_remembered_neighbour():
    async def scenario():
        async with swarm(3) as (a, b, c):
            stop = asyncio.Event()
            watch = asyncio.create_task(keep_in_dht(c, stop, 0.2))
            try:
                assert await b.store_own("peers", peer_record("b"), ttl_s=60)
                assert b.identity.peer_id in await c.read_field("peers")
                await asyncio.sleep(0.5)  # c remembers its neighbours
                stop.set()
                await watch
                _isolate(c, [a, b])
                assert not c.dht_neighbours()
                assert await b.store_own("peers", peer_record("b-after"), ttl_s=60)

                async def b_as_c_sees_it():
                    entry = (await c.read_field("peers")).get(b.identity.peer_id)
                    return entry.value["name"] if entry else None

                await asyncio.sleep(1.0)
                assert await b_as_c_sees_it() != "b-after"  # alone, and nobody asks it: it stays alone

                stop.clear()
                watch = asyncio.create_task(keep_in_dht(c, stop, 0.2))
                deadline = time.monotonic() + 15
                while await b_as_c_sees_it() != "b-after" and time.monotonic() < deadline:
                    await asyncio.sleep(0.2)
                assert await b_as_c_sees_it() == "b-after"  # back, through its contact a
                assert c.dht_neighbours()

                await a.shutdown()  # the contact c joined through is gone (a coordinator restarting)
                _isolate(c, [b])
                deadline = time.monotonic() + 15
                while not c.dht_neighbours() and time.monotonic() < deadline:
                    await asyncio.sleep(0.2)
                assert c.dht_neighbours() == [b.identity.peer_id]  # through b, whom it remembered
                assert await c.store_own("peers", peer_record("c"), ttl_s=60)
                assert c.identity.peer_id in await b.read_field("peers")
            finally:
                stop.set()
                await watch

    loop.run(scenario())


def test_a_node_that_stops_serving_the_dht_still_stores_and_reads_but_holds_no_ones_records():
    async def scenario():
        async with swarm(3) as (a, b, c):
            await c.serve_dht(False)
            assert await c.store_own("peers", peer_record("c"), ttl_s=60)
            assert await b.store_own("peers", peer_record("b"), ttl_s=60)
            assert {b.identity.peer_id, c.identity.peer_id} <= set(await c.read_field("peers"))
            assert c.identity.peer_id in await a.read_field("peers")
            # nobody can ask c for a record any more: a lookup of it fails, and the others drop it
            assert await a.dht.protocol.call_ping(c.p2p.peer_id) is None
            assert c.identity.peer_id not in a.dht_neighbours()
            await c.serve_dht(True)  # and back
            assert await a.dht.protocol.call_ping(c.p2p.peer_id) is not None

    loop.run(scenario())
