"""Finding a run through one known peer: its run id, the coordinator, the signed manifest, the round."""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass

from hetnode.daemon.lifecycle import Stopped, sleep_or_stop
from hetnode.errors import HetnodeError
from hetnode.net.identity import Identity, peer_id_from_maddr
from hetnode.net.node import DEFAULT_LIMITS, PeersUnreachable, SwarmNode
from hetnode.net.streams import PeerRequestError
from hetnode.wire.manifest import Manifest, manifest_from_envelope

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class RunContact:
    coordinator: str
    manifest: Manifest


async def find_run(
    node: SwarmNode, peer_maddr: str, timeout_s: float, stop: asyncio.Event, client_mode: bool = False
) -> RunContact:
    """Ask the known peer which run it serves, join that run's DHT and read the coordinator's manifest."""
    target = peer_id_from_maddr(peer_maddr)
    deadline = time.monotonic() + timeout_s
    info = None
    while info is None:
        try:
            info = await node.info(target, timeout=min(10.0, max(1.0, deadline - time.monotonic())))
        except PeerRequestError as exc:
            if time.monotonic() > deadline:
                raise HetnodeError(f"cannot reach {peer_maddr} within {timeout_s:.0f} s: {exc}") from None
            log.info("waiting for %s: %s", peer_maddr, exc)
            if await sleep_or_stop(stop, 1.0):
                raise Stopped("stopped before the swarm answered") from None
    if not info["run"]:
        raise HetnodeError(f"{peer_maddr} is not part of a run yet")
    coordinator = info["coordinator"] or target
    await node.join_dht(info["run"], [peer_maddr], client_mode=client_mode)
    while True:
        entry = (await node.read_field("manifest")).get(coordinator)
        if entry is not None:
            return RunContact(coordinator, manifest_from_envelope(entry.value))
        if time.monotonic() > deadline:
            raise HetnodeError(f"no manifest signed by {coordinator} in the DHT of run {info['run']}")
        if await sleep_or_stop(stop, 0.5):
            raise Stopped("stopped before the manifest was found")


async def start_when_reachable(
    identity: Identity,
    listen: list[str],
    peer_maddr: str,
    announce: tuple[str, ...],
    timeout_s: float,
    stop: asyncio.Event,
) -> SwarmNode | None:
    """Start our node bootstrapped from `peer_maddr`, retrying while that peer does not answer (it may be
    starting too, as in docker-compose). None when stopped first."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            return await SwarmNode.start(
                identity, DEFAULT_LIMITS, listen, initial_peers=[peer_maddr], announce_maddrs=announce
            )
        except PeersUnreachable as exc:
            if time.monotonic() > deadline:
                raise HetnodeError(f"cannot reach {peer_maddr} within {timeout_s:.0f} s ({exc})") from None
            log.info("waiting for %s to answer", peer_maddr)
        if await sleep_or_stop(stop, 2.0):
            return None


async def read_round(node: SwarmNode, coordinator: str) -> int | None:
    entry = (await node.read_field("round")).get(coordinator)
    if entry is None or not isinstance(entry.value, dict) or not isinstance(entry.value.get("round"), int):
        return None
    return entry.value["round"]
