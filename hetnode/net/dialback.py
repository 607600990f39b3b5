"""Reachability checks that dial for real, for the reachability line `hetnode join` prints.

Direct: the peer we joined through opens a fresh TCP connection to our libp2p port at the address our
connection to it comes from (after any NAT: the router's), and a libp2p listener must greet it. An
existing connection cannot prove anything: libp2p would reuse it. The asker names only a port, so a
dial-back can only ever reach the asker's own address.

Relayed: a throwaway libp2p peer of our own, which knows only our circuit address through the relay,
connects to us through it and pings our control handler: that is the path other peers' streams take.
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
from collections.abc import Sequence

from hivemind.p2p import P2P, PeerID

from hetnode.net.streams import request
from hetnode.wire.control import encode_request

log = logging.getLogger(__name__)

MULTISTREAM_GREETING = b"\x13/multistream/1.0.0\n"  # what a libp2p TCP listener sends first
DIAL_TIMEOUT_S = 3.0


def tcp_host_port(maddr: str) -> tuple[str, int] | None:
    """(ip, port) of a plain /ip4|/ip6/.../tcp/PORT multiaddr; None for relayed or other addresses."""
    parts = maddr.split("/")
    if "/p2p-circuit" in maddr or len(parts) < 5 or parts[1] not in ("ip4", "ip6") or parts[3] != "tcp":
        return None
    try:
        ipaddress.ip_address(parts[2])
        return parts[2], int(parts[4])
    except ValueError:
        return None


async def libp2p_listens(host: str, port: int, timeout: float = DIAL_TIMEOUT_S) -> bool:
    """True when a TCP connection to host:port opens and a libp2p listener greets it."""
    writer = None
    try:
        reader, writer = await asyncio.wait_for(asyncio.open_connection(host, port), timeout)
        greeting = await asyncio.wait_for(reader.readexactly(len(MULTISTREAM_GREETING)), timeout)
        return greeting == MULTISTREAM_GREETING
    except (OSError, TimeoutError, asyncio.IncompleteReadError):
        return False
    finally:
        if writer is not None:
            writer.close()


async def dial_back(connection_addrs: Sequence[str], port: int) -> bool | None:
    """Dial `port` at the addresses a peer's connections to us come from; None: no address to dial
    (the peer reached us through a relay, or over something other than TCP/IP)."""
    hosts = sorted({hp[0] for hp in map(tcp_host_port, connection_addrs) if hp is not None})
    if not hosts:
        return None
    results = await asyncio.gather(*(libp2p_listens(host, port) for host in hosts[:4]))
    return any(results)


async def reachable_through(relay_maddr: str, peer_id: str, handler: str, timeout: float = 20.0) -> bool:
    """Can a stranger reach `peer_id` through the relay `relay_maddr` (a full multiaddr with /p2p/)? A
    throwaway p2pd that listens nowhere bootstraps from our circuit address only, then pings us."""
    circuit = f"{relay_maddr}/p2p-circuit/p2p/{peer_id}"
    prober = None
    try:
        prober = await asyncio.wait_for(
            P2P.create(
                initial_peers=[circuit],
                host_maddrs=[],
                no_listen=True,
                dht_mode="client",
                check_if_identity_free=False,
            ),
            timeout,
        )
        if not any(info.peer_id == PeerID.from_base58(peer_id) for info in await prober.list_peers()):
            return False
        await request(prober, peer_id, handler, encode_request("ping"), timeout)
        return True
    except Exception as exc:  # any failure on this path means strangers cannot use it either
        log.info("no stream reached us through %s: %r", relay_maddr, exc)
        return False
    finally:
        if prober is not None:
            await prober.shutdown()
