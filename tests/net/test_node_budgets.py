"""Budgets and record caps on real p2pd daemons over loopback: what an attacker with free identities can
make a node do, and that an honest peer is still served meanwhile. Every node is shut down on exit."""

import asyncio
import contextlib
import time

import pytest
from hivemind.dht.crypto import RSASignatureValidator
from hivemind.dht.node import DHTNode

from hetnode.net import loop, streams
from hetnode.net.budgets import NodeBudgets
from hetnode.net.identity import ephemeral_identity, owner_subkey
from hetnode.net.node import CONTROL_HANDLER, NodeLimits, SwarmNode
from hetnode.net.records import new_peer_record, record_key
from hetnode.net.streams import PeerRequestError, read_frame
from hetnode.wire.control import decode_reply, encode_request, frame_header

LOOPBACK = ["/ip4/127.0.0.1/tcp/0"]
RUN = "testrun"
PROBE_BYTES = 256 * 1024
MiB = 2**20


def limits(**budgets) -> NodeLimits:
    return NodeLimits(PROBE_BYTES, probe_s=3.0, requests_per_min=600, budgets=NodeBudgets(**budgets))


@contextlib.asynccontextmanager
async def swarm(count, server_limits: NodeLimits):
    """A server (the first node, with `server_limits`) and `count - 1` clients on its DHT."""
    nodes = []
    try:
        server = await SwarmNode.start(ephemeral_identity(), server_limits, LOOPBACK)
        nodes.append(server)
        await server.join_dht(RUN, [])
        maddrs = await server.visible_maddrs()
        for _ in range(count - 1):
            node = await SwarmNode.start(ephemeral_identity(), limits(), LOOPBACK, initial_peers=maddrs)
            nodes.append(node)
            await node.join_dht(RUN, maddrs)
        yield nodes
    finally:
        for node in reversed(nodes):
            await node.shutdown()


async def until(condition, timeout=10.0):
    """Wait for `condition()` to hold (state that another task changes), failing after `timeout`."""
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "condition not reached in time"
        await asyncio.sleep(0.02)


async def raw_request(client: SwarmNode, server: SwarmNode, message: bytes):
    _, reader, writer = await client.p2p.call_binary_stream_handler(server.p2p.peer_id, CONTROL_HANDLER)
    try:
        writer.write(frame_header(len(message)) + message)
        await writer.drain()
        return decode_reply(await read_frame(reader, 2**16, timeout=15.0))
    finally:
        writer.close()


def test_an_attacker_holding_streams_is_refused_at_once_while_an_honest_peer_is_served(monkeypatch):
    monkeypatch.setattr(streams, "FIRST_FRAME_TIMEOUT_S", 30.0)  # the held streams stay held

    async def scenario():
        server_limits = limits(streams_per_peer=3, streams_global=5, streams_preferred=0)
        async with swarm(3, server_limits) as (server, attacker, honest):
            target = server.identity.peer_id
            held = []  # open streams that never send a request: each sits in the server's read
            try:
                for _ in range(3):
                    held.append(
                        await attacker.p2p.call_binary_stream_handler(server.p2p.peer_id, CONTROL_HANDLER)
                    )
                await until(lambda: server.budgets.streams.held_by(attacker.identity.peer_id) == 3)
                started = time.monotonic()
                with pytest.raises(PeerRequestError, match="busy: too many open streams \\(peer limit\\)"):
                    await attacker.ping(target)
                assert time.monotonic() - started < 3.0  # no read, no 10 s request timeout
                assert await honest.ping(target) > 0
                # two more from the honest peer fill the node: then the global limit refuses
                for _ in range(2):
                    held.append(
                        await honest.p2p.call_binary_stream_handler(server.p2p.peer_id, CONTROL_HANDLER)
                    )
                await until(lambda: server.budgets.streams.in_use == 5)
                with pytest.raises(PeerRequestError, match="global limit"):
                    await honest.ping(target)
                assert server.budgets.refusals["busy"] == 2
            finally:
                for _, _, writer in held:
                    writer.close()
            await until(lambda: server.budgets.streams.in_use == 0)  # slots come back when streams end
            assert await attacker.ping(target) > 0

    loop.run(scenario())


def test_a_crowd_of_idle_streams_leaves_the_preferred_slots_and_gives_its_own_back_soon(monkeypatch):
    monkeypatch.setattr(streams, "FIRST_FRAME_TIMEOUT_S", 2.0)

    async def scenario():
        server_limits = limits(streams_per_peer=4, streams_global=8, streams_preferred=2)
        async with swarm(4, server_limits) as (server, crowd_a, crowd_b, sealer):
            target = server.identity.peer_id
            server.prefer([sealer.identity.peer_id])
            held = []  # streams that never send their request
            try:
                for crowd in (crowd_a, crowd_b):
                    for _ in range(4):
                        held.append(
                            await crowd.p2p.call_binary_stream_handler(server.p2p.peer_id, CONTROL_HANDLER)
                        )
                await until(lambda: server.budgets.streams.in_use == 6)  # the 2 kept slots stay free
                await until(lambda: server.budgets.refusals["busy"] == 2)
                assert server.budgets.streams.in_use == 6
                assert await sealer.ping(target) > 0  # a preferred peer is served in a kept slot
                # an idle stream loses its slot within the first-frame deadline, not the request timeout
                await until(lambda: server.budgets.streams.in_use == 0, timeout=5.0)
                assert server.budgets.refusals["incomplete"] >= 6
            finally:
                for _, _, writer in held:
                    writer.close()

    loop.run(scenario())


def test_a_peer_the_probe_policy_refuses_gets_an_error_not_megabytes():
    async def scenario():
        async with swarm(3, limits()) as (server, stranger, member):
            server.set_probe_policy(lambda peer: peer == member.identity.peer_id)
            reply = await raw_request(
                stranger, server, encode_request("probe_down", bytes=PROBE_BYTES, seconds=3.0)
            )
            assert reply.type == "error" and reply["code"] == "policy"
            with pytest.raises(PeerRequestError, match="policy"):
                await stranger.measure_link(server.identity.peer_id)
            assert server.traffic["sent", "probe"] == server.traffic["received", "probe"] == 0
            assert server.budgets.refusals["policy:probe"] == 2
            link = await member.measure_link(server.identity.peer_id)
            assert link.down_mbps > 0 and server.traffic["sent", "probe"] == PROBE_BYTES

    loop.run(scenario())


def test_the_probe_budget_allows_a_probe_and_refuses_the_next_within_the_minute():
    async def scenario():
        async with swarm(2, limits()) as (server, client):
            server.limits = limits(
                probe_bytes_per_peer=2 * PROBE_BYTES
            )  # as a daemon does after the manifest
            await client.measure_link(server.identity.peer_id)  # up and down: the whole budget
            with pytest.raises(PeerRequestError, match="budget: probe budget \\(peer"):
                await client.measure_link(server.identity.peer_id)

    loop.run(scenario())


def test_state_is_encoded_once_for_many_askers_and_the_byte_budget_refuses_the_next_request():
    size, k = 1 * MiB, 3
    calls = []

    def provider(round_, shard):
        calls.append((round_, shard))
        time.sleep(0.5)  # a slow encoding runs off the loop: the node keeps answering meanwhile
        return bytes(size) if round_ == 7 else None

    async def scenario():
        async with swarm(3, limits(state_bytes_per_peer=k * size)) as (server, a, b):
            server.set_state(provider)
            peer = server.identity.peer_id
            fetches = [asyncio.create_task(c.fetch_state(peer, 7, "embed", 2 * size)) for c in (a, b)]
            await until(lambda: calls)
            started = time.monotonic()
            await a.ping(peer)
            assert time.monotonic() - started < 0.4  # answered while the provider sleeps
            assert [len(data) for data in await asyncio.gather(*fetches)] == [size, size]
            for _ in range(k - 1):
                assert len(await a.fetch_state(peer, 7, "embed", 2 * size)) == size
            assert calls == [(7, "embed")]
            with pytest.raises(PeerRequestError, match="budget: state budget"):
                await a.fetch_state(peer, 7, "embed", 2 * size)  # the (k+1)-th
            assert len(await b.fetch_state(peer, 7, "embed", 2 * size)) == size  # per peer
            assert server.traffic["sent", "state"] == (k + 2) * size

    loop.run(scenario())


def test_the_payload_budget_refuses_inside_a_pipelined_fetch_with_its_reason():
    held = {(1, s, "r"): bytes(100_000) for s in ("a", "b", "c")}

    async def scenario():
        async with swarm(2, limits(payload_bytes_per_peer=250_000)) as (server, client):
            server.set_payloads(lambda round_, shard, replica, asker: held.get((round_, shard, replica)))
            peer = server.identity.peer_id
            assert len(await client.fetch_payloads(peer, 1, [("a", "r"), ("b", "r")], MiB)) == 2
            with pytest.raises(PeerRequestError, match="budget: payload budget"):
                await client.fetch_payloads(peer, 1, [("c", "r"), ("a", "r")], MiB)

    loop.run(scenario())


def _seal(round_=3):
    return {"round": round_, "contributions": [], "excluded": [], "sealed_at": time.time(), "prev": ""}


def _peer(name="p", **changes):
    digests = {"embed": "0" * 16, "head": "1" * 16, "0": "2" * 16}
    link = {"link_class": "low", "up_mbps": 20.0, "down_mbps": 20.0, "mem_gb": 1.0, "tflops": 0.5}
    return new_peer_record(name, wants="stage", layer_digests=digests, **link) | changes


def test_records_that_live_too_long_or_weigh_too_much_are_refused_and_honest_ones_kept():
    async def scenario():
        async with swarm(2, limits()) as (a, b):
            assert not await b.store_own("seal", _seal(), ttl_s=10 * 365 * 86400)
            giant = {str(i): "f" * 64 for i in range(300)}  # within the schema's 1026 shards, ~21 KB
            assert not await b.store_own("peers", _peer(layer_digests=giant), ttl_s=30)
            assert await b.store_own("seal", _seal(), ttl_s=3600)
            assert await b.store_own("peers", _peer("b"), ttl_s=30)
            assert set(await a.read_field("peers")) == {b.identity.peer_id}
            assert (await a.read_field("seal"))[b.identity.peer_id].value["round"] == 3

    loop.run(scenario())


def test_an_over_cap_record_held_by_a_relay_running_other_code_is_not_read():
    """A relay that signs its own 10-year record and stores it without our caps (other code)."""

    async def scenario():
        async with swarm(2, limits()) as (a, b):
            relay_identity = ephemeral_identity()
            relay = await DHTNode.create(
                initial_peers=await a.visible_maddrs(),
                host_maddrs=LOOPBACK,
                record_validator=RSASignatureValidator(relay_identity.private_key),
            )
            try:
                key, subkey = record_key(RUN, "seal"), owner_subkey(relay_identity)
                await relay.store(key, _seal(9), time.time() + 10 * 365 * 86400, subkey=subkey)
                assert (await relay.get(key, latest=True)) is not None  # the relay keeps it
                assert relay_identity.peer_id not in await a.read_field("seal")
                assert relay_identity.peer_id not in await b.read_field("seal")
            finally:
                await relay.shutdown()

    loop.run(scenario())
