"""The path beside the DHT on real p2pd daemons over loopback: a peer's own entries of the round's fields,
asked of it directly, checked as DHT entries are; a hostile answer is refused (a log line), never raised."""

import contextlib

from hetnode.net import loop
from hetnode.net.identity import ephemeral_identity
from hetnode.net.node import NodeLimits, SwarmNode

LOOPBACK = ["/ip4/127.0.0.1/tcp/0"]
LIMITS = NodeLimits(probe_bytes=2**20, probe_s=3.0, requests_per_min=600)
RUN = "directrun"
SEAL = {"round": 4, "contributions": [], "excluded": [], "sealed_at": 1.0, "prev": ""}


@contextlib.asynccontextmanager
async def pair():
    """Two nodes that share a DHT of their own; shut down on exit."""
    nodes = []
    try:
        first = await SwarmNode.start(ephemeral_identity(), LIMITS, LOOPBACK)
        nodes.append(first)
        await first.join_dht(RUN, [])
        maddrs = await first.visible_maddrs()
        second = await SwarmNode.start(ephemeral_identity(), LIMITS, LOOPBACK, initial_peers=maddrs)
        nodes.append(second)
        await second.join_dht(RUN, maddrs)
        yield first, second
    finally:
        for node in reversed(nodes):
            await node.shutdown()


def test_a_peer_hands_over_its_own_entry_directly_and_only_a_valid_one_is_taken():
    async def scenario():
        async with pair() as (sealer, replica):
            peer = sealer.identity.peer_id
            assert await replica.read_direct(peer, "seal") is None  # none stored yet
            await sealer.store_own("seal", SEAL, ttl_s=60.0)
            entry = await replica.read_direct(peer, "seal")
            assert entry is not None and entry.value == SEAL and entry.peer_id == peer
            assert await replica.read_direct(peer, "changes") is None  # not a field served directly
            # a hostile answer: not a seal, then an entry that lives past its cap
            sealer._own["seal"] = ({"round": "four"}, entry.expiration)
            assert await replica.read_direct(peer, "seal") is None
            sealer._own["seal"] = (SEAL, entry.expiration + 10**6)
            assert await replica.read_direct(peer, "seal") is None
            # an expired entry is not served
            sealer._own["seal"] = (SEAL, 1.0)
            assert await replica.read_direct(peer, "seal") is None

    loop.run(scenario())
