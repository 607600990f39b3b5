"""Who answers at the address of a `--peer` multiaddr that p2pd could not bootstrap from.

p2pd says only "failed to connect to bootstrap peers", for a port where nothing listens and for a live
peer with another id alike. The usual second case is a coordinator restarted with another `--data-dir`:
same port, a new key, so a new peer id. Waiting cannot mend that, so `join` and `status` tell the two
apart: a TCP dial says whether a libp2p listener greets at the address at all, and only then a throwaway
p2pd dials the id we were given there; libp2p's security handshake refuses it with "peer id mismatch:
expected <given>, but remote key matches <actual>", which names the id that does answer.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re

from hivemind.p2p import P2P, PeerID
from hivemind.utils.multiaddr import Multiaddr

from hetnode.net.dialback import libp2p_listens, tcp_host_port

log = logging.getLogger(__name__)

PROBE_TIMEOUT_S = 5.0
_MISMATCH = re.compile(r"peer id mismatch: expected \w+, but remote key matches (\w+)")


async def listener_at(maddr: str) -> bool:
    """True when a libp2p listener greets at the TCP address of `maddr` (whoever it is)."""
    address = tcp_host_port(maddr)
    return address is not None and await libp2p_listens(*address)


async def other_peer_id_at(maddr: str, expected: str, timeout: float = PROBE_TIMEOUT_S) -> str | None:
    """The peer id of the libp2p peer at `maddr`'s TCP address when it is not `expected`; None when
    nothing libp2p listens there, when `expected` itself answers, or when the dial fails otherwise."""
    if not await listener_at(maddr):
        return None
    address = maddr.split("/p2p/")[0]
    prober = None
    try:
        prober = await asyncio.wait_for(
            P2P.create(host_maddrs=[], no_listen=True, dht_mode="client", check_if_identity_free=False),
            timeout,
        )
        # hivemind has no public call to dial one address; SwarmNode.rejoin_dht uses the same client
        await asyncio.wait_for(
            prober._client.connect(PeerID.from_base58(expected), [Multiaddr(address)]), timeout
        )
        return None  # the peer we were given answers now
    except Exception as exc:  # p2pd's ControlFailure carries libp2p's words; anything else tells nothing
        found = _MISMATCH.search(str(exc))
        log.debug("dialling %s at %s: %s", expected, address, exc)
        return found.group(1) if found and found.group(1) != expected else None
    finally:
        if prober is not None:
            with contextlib.suppress(Exception):
                await prober.shutdown()
