"""Fetching sealed payloads from any holder, over real p2pd nodes on loopback: a holder that lies, lacks
the payload or is gone is passed over, and what is fetched is exactly the sealed bytes."""

import pytest

from hetnode.daemon.payload_fetch import PayloadsUnavailable, fetch_sealed
from hetnode.daemon.rounds import sha256_hex
from hetnode.net import loop

pytestmark = pytest.mark.slow

PAYLOAD = bytes(range(256)) * 64  # any bytes: the fetcher checks them against the seal's sha256 only


def test_liars_and_empty_holders_are_passed_over_until_someone_serves_the_sealed_bytes(nodes_on_loopback):
    async def scenario():
        async with nodes_on_loopback(6, "fetch-test") as nodes:
            fetcher, author, liar, empty, sealer, gone = nodes
            key = (author.identity.peer_id, "0")

            def serving(data):
                return lambda round_, shard, replica: (
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
