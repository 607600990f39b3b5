"""An author keeps its unsealed payload from all but the round's sealers, over real p2pd nodes on loopback:
a copier asking before the seal is refused (and could not announce the bytes as its own work), the
coordinator is served at once, and a reader asking just before the seal reaches the author is served as
soon as it does."""

import asyncio

import pytest

from hetnode.daemon.held_payloads import UNSEALED_WAIT_S, HeldPayloads
from hetnode.net import loop
from hetnode.net.streams import PeerRequestError

pytestmark = pytest.mark.slow

PAYLOAD = b"our signed payload of round 5" * 100


def test_an_unsealed_payload_goes_to_its_sealers_only_and_to_everyone_once_sealed(nodes_on_loopback):
    async def scenario():
        async with nodes_on_loopback(4, "held-test") as nodes:
            author, coordinator, copier, reader = nodes
            ids = {n: n.identity.peer_id for n in nodes}
            wakes = []
            held = HeldPayloads(
                ids[author], {ids[coordinator]}, lambda r, s, p: None, lambda: wakes.append(1), lambda: 4
            )
            held.keep_own(5, {"0": PAYLOAD})
            author.set_payloads(held.serve)
            wanted = [("0", ids[author])]

            assert await coordinator.fetch_payloads(ids[author], 5, wanted, 2**20) == [PAYLOAD]
            with pytest.raises(PeerRequestError, match="round 5 is not sealed"):
                await copier.fetch_payloads(ids[author], 5, wanted, 2**20)
            assert held.refused == 1 and wakes  # the request woke the seal wait: it might have been sealed

            # the seal reaches the reader first; the author sees it a moment later and serves then
            asking = asyncio.create_task(reader.fetch_payloads(ids[author], 5, wanted, 2**20))
            await asyncio.sleep(UNSEALED_WAIT_S / 3)
            assert not asking.done()
            held.saw_seal(5)
            assert await asking == [PAYLOAD]
            assert await copier.fetch_payloads(ids[author], 5, wanted, 2**20) == [PAYLOAD]  # too late to copy
            assert held.refused == 1

    loop.run(scenario())
