"""Finding a run through one known peer: its run id, the coordinator, the signed manifest, the round.

A volunteer pins the coordinator it meant (docs/security.md, "Who is trusted with what"): the peer it joins
through only helps it find the DHT, and a member that names another coordinator is refused. What the manifest
says about local paths (the data source beyond the bundled corpus, the data cache) is never taken:
`local_config` replaces them
with the volunteer's own."""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass

from hetnode.config import Config, replace
from hetnode.daemon.peer_address import another_peer_error
from hetnode.errors import ConfigError, HetnodeError
from hetnode.net.identity import Identity
from hetnode.net.node import DEFAULT_LIMITS, PeersUnreachable, SwarmNode
from hetnode.net.peer_ids import peer_id_from_maddr
from hetnode.net.streams import PeerRequestError
from hetnode.net.who_answers import listener_at, other_peer_id_at
from hetnode.service.lifecycle import Stopped, sleep_or_stop, unless_stopped
from hetnode.wire.manifest import Manifest, manifest_from_envelope

log = logging.getLogger(__name__)

RETRY_S = 2.0  # between attempts to reach a peer that may be starting
MIN_START_S = 5.0  # one p2pd start, even when the timeout is nearly spent


@dataclass(frozen=True)
class RunContact:
    coordinator: str
    manifest: Manifest


class CoordinatorNotPinned(HetnodeError):
    """A volunteer joined through a member without saying which coordinator it means to follow."""


async def find_run(
    node: SwarmNode,
    peer_maddr: str,
    timeout_s: float,
    stop: asyncio.Event,
    client_mode: bool = False,
    pinned: str | None = None,
    require_pin: bool = False,
) -> RunContact:
    """Ask the known peer which run it serves, join that run's DHT and read the coordinator's manifest.

    `pinned`: the coordinator we mean to follow; a peer that names another is refused. With `require_pin`
    and no pin, only the coordinator itself may be the peer we join through (status queries need none)."""
    target = peer_id_from_maddr(peer_maddr)
    deadline = time.monotonic() + timeout_s
    info = None
    while info is None:
        try:
            ask = node.info(target, timeout=min(10.0, max(1.0, deadline - time.monotonic())))
            info = await unless_stopped(stop, ask, f"asking {peer_maddr} which run it serves")
        except PeerRequestError as exc:
            if time.monotonic() > deadline:
                raise HetnodeError(f"cannot reach {peer_maddr} within {timeout_s:g} s: {exc}") from None
            log.info("waiting for %s: %s", peer_maddr, exc)
            if await sleep_or_stop(stop, 1.0):
                raise Stopped("stopped before the swarm answered") from None
    if not info["run"]:
        raise HetnodeError(f"{peer_maddr} is not part of a run yet")
    coordinator = info["coordinator"] or target
    if pinned is not None and coordinator != pinned:
        raise HetnodeError(
            f"{peer_maddr} follows coordinator {coordinator}, not the pinned {pinned}: refusing to join"
        )
    if require_pin and pinned is None and coordinator != target:
        raise CoordinatorNotPinned(
            f"{peer_maddr} is a member of run {info['run']}, not its coordinator; to trust its coordinator "
            f"{coordinator}, pass --coordinator {coordinator} (check it against the coordinator's READY line "
            "or status page), or join through the coordinator's own address or http://HOST:PORT"
        )
    joining = node.join_dht(info["run"], [peer_maddr], client_mode=client_mode, coordinator=coordinator)
    await unless_stopped(stop, joining, f"joining the DHT of run {info['run']}")
    while True:
        manifests = await unless_stopped(stop, node.read_field("manifest"), "reading the run's manifest")
        entry = manifests.get(coordinator)
        if entry is None:  # hidden or lost in the DHT: the coordinator hands it over itself
            entry = await unless_stopped(
                stop, node.read_direct(coordinator, "manifest"), "asking for the manifest"
            )
        if entry is not None:
            manifest = manifest_from_envelope(entry.value)
            node.set_sealers(manifest.stand_ins)  # with the coordinator, the only writers of a seal we keep
            return RunContact(coordinator, manifest)
        if time.monotonic() > deadline:
            raise HetnodeError(
                f"no manifest signed by {coordinator} in the DHT of run {info['run']} within {timeout_s:g} s"
            )
        if await sleep_or_stop(stop, 0.5):
            raise Stopped("stopped before the manifest was found")


async def start_when_reachable(
    identity: Identity,
    listen: list[str],
    peer_maddr: str,
    announce: tuple[str, ...],
    timeout_s: float,
    stop: asyncio.Event,
    relay_service: bool = False,
    relay_via: tuple[str, ...] = (),
) -> SwarmNode | None:
    """Start our node bootstrapped from `peer_maddr`, retrying while that peer does not answer (it may be
    starting too, as in docker-compose). None when stopped first; an error naming the reason once
    `timeout_s` has passed, or at once when another peer id answers at that address (waiting will not
    change its key). `relay_service`, `relay_via`: as in `SwarmNode.start`."""
    deadline = time.monotonic() + timeout_s
    asked_who = False
    while True:
        # one start may take long when the peer's packets are dropped (p2pd waits for its dial)
        attempt = SwarmNode.start(
            identity,
            DEFAULT_LIMITS,
            listen,
            initial_peers=[peer_maddr],
            announce_maddrs=announce,
            relay_service=relay_service,
            relay_via=relay_via,
        )
        budget = max(MIN_START_S, deadline - time.monotonic())
        try:
            return await unless_stopped(stop, asyncio.wait_for(attempt, budget), f"waiting for {peer_maddr}")
        except Stopped:
            return None
        except (PeersUnreachable, TimeoutError) as exc:
            reason = str(exc) if isinstance(exc, PeersUnreachable) else f"no answer in {budget:.0f} s"
            if isinstance(exc, PeersUnreachable) and not asked_who:  # once: a listener that is up stays up
                asked_who = True
                try:
                    await refuse_another_peer(peer_maddr, stop)
                except Stopped:
                    return None
            left = deadline - time.monotonic()
            if left < RETRY_S:  # no time for another attempt: a p2pd start takes a second or two
                if isinstance(exc, PeersUnreachable) and not await listener_at(peer_maddr):
                    where = peer_maddr.split("/p2p/")[0]
                    reason = f"nothing answered at {where} (is it running, on that port?)"
                raise HetnodeError(
                    f"cannot reach {peer_maddr} within {timeout_s:g} s (--connect-timeout): {reason}"
                ) from None
            log.info("waiting for %s to answer (%s)", peer_maddr, reason)
        if await sleep_or_stop(stop, RETRY_S):
            return None


async def refuse_another_peer(peer_maddr: str, stop: asyncio.Event) -> None:
    """Raise the `--peer` error (exit 2) when a peer with another id than `peer_maddr`'s answers at its
    address; return when nothing does, or the peer we were given does."""
    given = peer_id_from_maddr(peer_maddr)
    actual = await unless_stopped(stop, other_peer_id_at(peer_maddr, given), f"asking who is at {peer_maddr}")
    if actual is not None:
        raise another_peer_error(peer_maddr, given, actual)


async def read_round(node: SwarmNode, coordinator: str) -> int | None:
    entry = (await node.read_field("round")).get(coordinator)
    if entry is None or not isinstance(entry.value, dict) or not isinstance(entry.value.get("round"), int):
        return None
    return entry.value["round"]


def local_config(
    manifest_config: Config, data_source: str | None, data_cache: str, allow_repeats: bool = False
) -> Config:
    """The run's config as this volunteer trains it: the manifest's model and schedule, but the volunteer's
    own local paths. A manifest may name the bundled corpus ("wiki"); any other source names a path on the
    coordinator's machine, which a volunteer must supply itself (`--data-source`). `allow_repeats`
    (`--allow-repeats`) lifts the epoch guard (train.max_epochs) for this volunteer only."""
    source = data_source
    if source is None:
        if manifest_config.data.source != "wiki":
            raise ConfigError(
                "--data-source",
                "data.source",
                f"the run trains on {manifest_config.data.source!r}, a path on the coordinator's machine; "
                "a volunteer never reads a path a manifest names: pass --data-source with your own copy",
            )
        source = "wiki"
    config = replace(manifest_config, "data", source=source, data_dir=data_cache)
    return replace(config, "train", max_epochs=0.0) if allow_repeats else config
