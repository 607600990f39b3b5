"""The dial-back a contact makes for a joining peer: it dials only the addresses the peer's connections come
from, and counts a port as reachable only when a libp2p listener greets it."""

from __future__ import annotations

import asyncio

from hetnode.net.dialback import MULTISTREAM_GREETING, dial_back, tcp_host_port


def test_only_plain_tcp_addresses_are_dialled():
    assert tcp_host_port("/ip4/10.1.0.2/tcp/4001") == ("10.1.0.2", 4001)
    assert tcp_host_port("/ip4/10.1.0.2/tcp/4001/p2p/QmX") == ("10.1.0.2", 4001)
    assert tcp_host_port("/ip4/10.1.0.1/tcp/4001/p2p/QmR/p2p-circuit") is None
    assert tcp_host_port("/ip4/10.1.0.2/udp/4001/quic-v1") is None
    assert tcp_host_port("/dns4/example.org/tcp/4001") is None


def test_a_port_counts_only_when_a_libp2p_listener_greets():
    async def scenario() -> tuple:
        async def libp2p(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            writer.write(MULTISTREAM_GREETING)
            await writer.drain()
            writer.close()

        async def other(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            writer.write(b"HTTP/1.1 400 Bad Request\r\n\r\n")
            await writer.drain()
            writer.close()

        good = await asyncio.start_server(libp2p, "127.0.0.1", 0)
        bad = await asyncio.start_server(other, "127.0.0.1", 0)
        ports = [s.sockets[0].getsockname()[1] for s in (good, bad)]
        seen = ["/ip4/127.0.0.1/tcp/55555"]  # where the asker's connection comes from
        try:
            return (
                await dial_back(seen, ports[0]),
                await dial_back(seen, ports[1]),
                await dial_back(["/ip4/10.0.0.1/tcp/1/p2p/QmR/p2p-circuit"], ports[0]),
            )
        finally:
            good.close()
            bad.close()

    assert asyncio.run(scenario()) == (True, False, None)  # relayed askers: nothing to dial
