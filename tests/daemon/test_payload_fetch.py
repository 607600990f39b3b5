"""Fetching sealed payloads from any holder, over real p2pd nodes on loopback: a holder that lies, lacks
the payload or is gone is passed over, and what is fetched is exactly the sealed bytes."""

import asyncio
import time

import pytest

from hetnode.daemon.payload_fetch import PayloadsUnavailable, fetch_sealed
from hetnode.net import loop
from hetnode.replica.global_model import sha256_hex

pytestmark = pytest.mark.slow

PAYLOAD = bytes(range(256)) * 64  # any bytes: the fetcher checks them against the seal's sha256 only


def test_liars_and_empty_holders_are_passed_over_until_someone_serves_the_sealed_bytes(nodes_on_loopback):
    async def scenario():
        async with nodes_on_loopback(6, "fetch-test") as nodes:
            fetcher, author, liar, empty, sealer, gone = nodes
            key = (author.identity.peer_id, "0")

            def serving(data):
                return lambda round_, shard, replica, asker: (
                    data if (replica, shard) == key and round_ == 0 else None
                )

            author.set_payloads(serving(PAYLOAD))
            sealer.set_payloads(serving(PAYLOAD))
            liar.set_payloads(serving(b"not the sealed payload" * 100))
            empty.set_payloads(serving(None))
            await gone.shutdown()
            digests = {key: sha256_hex(PAYLOAD)}
            ids = {n: n.identity.peer_id for n in nodes}

            got = await fetch_sealed(fetcher, 0, {key: [ids[liar], ids[empty], ids[sealer]]}, digests, 2**20)
            assert got.payloads == {key: PAYLOAD}
            assert got.bytes_from == {ids[sealer]: len(PAYLOAD)}
            assert got.passed_over == {ids[liar], ids[empty]}

            got = await fetch_sealed(fetcher, 0, {key: [ids[gone], ids[author]]}, digests, 2**20)
            assert got.bytes_from == {ids[author]: len(PAYLOAD)} and got.passed_over == {ids[gone]}

            with pytest.raises(PayloadsUnavailable, match="no holder served 1"):
                await fetch_sealed(fetcher, 0, {key: [ids[liar], ids[empty]]}, digests, 2**20)

    loop.run(scenario())


def test_holders_that_stall_are_passed_over_within_the_stall_timeout_and_the_rest_spread(nodes_on_loopback):
    """Hostile holders accept the request and then send nothing, or serve one payload and stall on the
    next: each costs the fetcher one stall timeout, once per round, and the payloads come from elsewhere."""

    async def scenario():
        async with nodes_on_loopback(7, "stall-test") as nodes:
            fetcher, staller, trickler, sealer, *authors = nodes
            ids = {n: n.identity.peer_id for n in nodes}
            payloads = {(ids[a], shard): bytes([i]) * 4096 for i, a in enumerate(authors) for shard in "01"}
            never = asyncio.Event()

            def honest(round_, shard, replica, asker):
                return payloads.get((replica, shard))

            async def stall(round_, shard, replica, asker):
                await never.wait()

            served_once: set = set()

            async def trickle(round_, shard, replica, asker):
                if served_once:
                    await never.wait()
                served_once.add((replica, shard))
                return payloads.get((replica, shard))

            for node in [sealer, *authors]:
                node.set_payloads(honest)
            staller.set_payloads(stall)
            trickler.set_payloads(trickle)
            digests = {key: sha256_hex(data) for key, data in payloads.items()}
            # every payload lists the hostile holders first, as if they ranked first for us
            order = {key: [ids[staller], ids[trickler], key[0], ids[sealer]] for key in payloads}

            started = time.monotonic()
            got = await fetch_sealed(fetcher, 0, order, digests, 2**20, stall_s=1.0)
            took = time.monotonic() - started
            assert got.payloads == payloads
            assert got.passed_over == {ids[staller], ids[trickler]}
            # the authors served their own payloads, all in parallel; the sealer served nothing
            assert got.bytes_from == {ids[a]: 2 * 4096 for a in authors}
            assert took < 2 * 1.0 + 1.5  # a stall timeout per hostile holder at most, not per payload
            never.set()

    loop.run(scenario())
