"""Joining from behind a NAT: find out whether the swarm can dial us, and if not, take a relay slot.

1. Start our node and ask the peer we joined through to dial our port back (a fresh connection).
2. If it cannot, restart our node (same key, same port) holding a relay slot on that peer, announcing our
   circuit address through it, and check that a stranger's stream reaches us that way.
3. The verdict (`planning.reachability.judge`) says which path we got; streams to us (payload fetches,
   chain neighbours) then take our direct address or the relay, whichever the verdict names.

This runs before the run's DHT is joined, so the restart costs a p2pd start (well under a second).
"""

from __future__ import annotations

import asyncio
import logging
import re

from hetnode.daemon.swarm import start_when_reachable
from hetnode.errors import HetnodeError
from hetnode.net.identity import Identity
from hetnode.net.node import SwarmNode
from hetnode.net.peer_ids import peer_id_from_maddr
from hetnode.net.streams import PeerRequestError
from hetnode.planning.reachability import Reachability, judge
from hetnode.service.lifecycle import Stopped, sleep_or_stop, unless_stopped

log = logging.getLogger(__name__)

RELAY_CHECK_TRIES = 3  # autorelay takes its slot just after p2pd starts: a first check may be early
DIAL_BACK_TRIES = 2  # a dial-back request dropped once is asked again


async def reach_swarm(
    identity: Identity,
    listen: str,
    peer_maddr: str,
    announce: tuple[str, ...],
    timeout_s: float,
    stop: asyncio.Event,
    relay_service: bool = False,
) -> tuple[SwarmNode | None, Reachability | None]:
    """Our node, started so that the swarm can reach it if it can be reached at all, and the verdict
    (None, None when stopped first; a None verdict: judge from addresses once the run is found)."""
    node = await start_when_reachable(
        identity, [listen], peer_maddr, announce, timeout_s, stop, relay_service=relay_service
    )
    if node is None:
        return None, None
    contact = peer_id_from_maddr(peer_maddr)
    direct = await node.direct_maddrs()
    port = _port_of(direct)
    answer = None
    for attempt in range(DIAL_BACK_TRIES if port is not None else 0):
        try:
            asking = node.ask_dial_back(contact, port)  # up to 15 s: a Ctrl+C must not wait for it
            answer = await unless_stopped(stop, asking, f"asking {contact} to dial us back")
            break
        except Stopped:
            await node.shutdown()
            return None, None
        except (PeerRequestError, TimeoutError, HetnodeError) as exc:
            # a busy contact may drop one request (seen on a loaded CI machine): the verdict from
            # addresses alone cannot tell a NAT from a local swarm, so ask once more before it
            if attempt + 1 < DIAL_BACK_TRIES:
                log.info("%s did not answer a dial-back (%s): asking again", contact, exc)
                await asyncio.sleep(1.0)
            else:
                log.info("%s did not answer a dial-back (%s): judging from addresses", contact, exc)
    if answer is not False or relay_service:  # a relay is never itself relayed
        return node, None if answer is None else judge(answer, None, await node.visible_maddrs(), peer_maddr)
    log.info("the swarm cannot dial port %d: taking a relay slot on %s", port, contact)
    await node.shutdown()
    fixed = re.sub(r"/tcp/0(?=/|$)", f"/tcp/{port}", listen)  # keep the port the others saw
    relayed_node = await start_when_reachable(
        identity, [fixed], peer_maddr, announce or tuple(direct), timeout_s, stop, relay_via=(peer_maddr,)
    )
    if relayed_node is None:
        return None, None
    relayed = False
    for attempt in range(RELAY_CHECK_TRIES):
        try:
            checking = relayed_node.reachable_through(peer_maddr)  # up to 20 s each
            relayed = await unless_stopped(stop, checking, f"checking the relay slot on {contact}")
        except Stopped:
            await relayed_node.shutdown()
            return None, None
        if relayed or attempt == RELAY_CHECK_TRIES - 1:
            break
        if await sleep_or_stop(stop, 1.0):
            await relayed_node.shutdown()
            return None, None
    verdict = judge(False, relayed, await relayed_node.visible_maddrs(), peer_maddr, relay=contact)
    return relayed_node, verdict


def _port_of(maddrs: list[str]) -> int | None:
    for maddr in maddrs:
        match = re.search(r"/tcp/(\d+)", maddr)
        if match and int(match.group(1)) > 0:
            return int(match.group(1))
    return None
