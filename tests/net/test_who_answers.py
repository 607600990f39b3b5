"""Who answers at a multiaddr's address: the id of a live libp2p peer that is not the one we were given
(read from libp2p's "peer id mismatch"), and nothing where nothing listens or the right peer answers."""

from __future__ import annotations

import asyncio

from hivemind.p2p import P2P

from hetnode.daemon.peer_address import another_peer_error
from hetnode.net.identity import ephemeral_identity
from hetnode.net.who_answers import listener_at, other_peer_id_at


def test_another_peer_id_is_named_and_the_right_one_or_nobody_is_not():
    async def scenario() -> tuple:
        live = await P2P.create(host_maddrs=["/ip4/127.0.0.1/tcp/0"])
        try:
            maddr = str((await live.get_visible_maddrs())[0])
            address, real = maddr.split("/p2p/")[0], live.peer_id.to_base58()
            stranger = ephemeral_identity().peer_id
            return (
                real,
                await other_peer_id_at(f"{address}/p2p/{stranger}", stranger),
                await other_peer_id_at(maddr, real),
                await listener_at(maddr),
            )
        finally:
            await live.shutdown()

    real, wrong, right, listening = asyncio.run(scenario())
    assert wrong == real and right is None and listening
    nobody = ephemeral_identity().peer_id
    assert asyncio.run(other_peer_id_at(f"/ip4/127.0.0.1/tcp/9/p2p/{nobody}", nobody)) is None


def test_the_error_names_both_ids_the_new_address_and_the_url():
    error = another_peer_error("/ip4/10.0.0.5/tcp/31337/p2p/QmOld", "QmOld", "12D3KooWNew")
    text = f"{error.path}: {error.message}"
    assert text.startswith("--peer: something answered at /ip4/10.0.0.5/tcp/31337 with another peer id")
    assert "(12D3KooWNew), not QmOld" in text and "--data-dir" in text
    assert "/ip4/10.0.0.5/tcp/31337/p2p/12D3KooWNew" in text and "http://10.0.0.5:PORT" in text
