"""A replica's part in sealed rounds, shared by anchors and chain stages (DESIGN §3.5–3.6).

`RoundParticipant` announces a payload, waits for the seal (the coordinator's, or the lowest-id live
anchor's when the coordinator is silent: only anchors stand in), fetches exactly the sealed payloads,
checks their sha256 against the seal and applies all of them or none. When a round cannot be applied here
it catches up by downloading θ from the coordinator.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from hetnode.config import Config
from hetnode.daemon.lifecycle import sleep_or_stop, sleep_or_wake
from hetnode.daemon.metrics import PeerMetrics
from hetnode.daemon.round_log import RoundRecord, append_round
from hetnode.daemon.rounds import GlobalModel, sha256_hex
from hetnode.daemon.sealing import Sealer
from hetnode.daemon.view import RecentView, SwarmView
from hetnode.errors import HetnodeError, WireError
from hetnode.net.node import SwarmNode
from hetnode.net.streams import PeerRequestError
from hetnode.planning.rounds import Announcement, seal_now

log = logging.getLogger(__name__)

ANNOUNCE_TTL_S = 300.0
POLL_S = 1.0  # seals are nudged to us: polling is the fallback (a lost nudge, a stand-in sealer)


class RoundFailed(HetnodeError):
    """A sealed round could not be applied here (payload unavailable or invalid): catch up from state."""


async def read_seal(node: SwarmNode, coordinator: str) -> dict[str, Any] | None:
    entry = (await node.read_field("seal")).get(coordinator)
    return entry.value if entry is not None and isinstance(entry.value, dict) else None


async def fetch_state(
    node: SwarmNode,
    source: str,
    global_model: GlobalModel,
    round_: int,
    expect_digests: dict[str, str] | None = None,
) -> None:
    """Download θ after `round_` shard by shard from `source` and load it (all or nothing), checked
    against the layer digests the source publishes for that round when we have them."""
    max_bytes = int(global_model.config.network.max_frame_mb * 2**20)
    payloads = {}
    for shard in global_model.shards:
        payloads[shard] = await node.fetch_state(source, round_, shard, max_bytes)
    await asyncio.to_thread(global_model.load_state, round_, payloads, expect_digests)


class RoundParticipant:
    """One replica's side of the round protocol. `keep(round, payloads)` holds what it is about to announce,
    served to the sealer (and, for a stand-in seal, to every replica) until the next round is sealed."""

    def __init__(
        self,
        config: Config,
        node: SwarmNode,
        coordinator: str,
        global_model: GlobalModel,
        may_stand_in: bool,
        data_dir: Path,
        metrics: PeerMetrics | None = None,
    ) -> None:
        self.config = config
        self.node = node
        self.coordinator = coordinator
        self.global_model = global_model
        self.outbox: dict[int, dict[str, bytes]] = {}  # round -> shard -> our encoded payload
        self.may_stand_in = may_stand_in  # anchors only: a stage never seals
        self.data_dir = data_dir  # gets the round log
        self.metrics = metrics
        self.peer_id = node.identity.peer_id
        self.sealer = Sealer(config, node, global_model, self.own_payload)
        self.view = RecentView(node, config, max_age_s=config.network.heartbeat_s)
        self.last_seal_wait_s = 0.0  # of the last wait_for_seal
        self.last_apply = (0.0, 0, 0.0)  # (seconds, bytes fetched, seconds fetching) of the last apply
        node.set_payloads(self.serve_payload)
        node.set_state(self.serve_state)
        self._sealed = asyncio.Event()  # the sealer nudged us: a seal is in the DHT
        node.set_nudge_handler(self._on_nudge)

    def _on_nudge(self, peer: str, topic: str, round_: int) -> None:
        if topic == "seal":
            self._sealed.set()

    def keep(self, round_: int, payloads: dict[str, bytes]) -> None:
        """Hold our payloads of `round_` (and of the round before, which a late sealer may still fetch)."""
        self.outbox = {r: p for r, p in self.outbox.items() if r >= round_ - 1}
        self.outbox[round_] = payloads

    def own_payload(self, round_: int, shard: str) -> bytes | None:
        return self.outbox.get(round_, {}).get(shard)

    def serve_state(self, round_: int, shard: str) -> bytes | None:
        """θ as we hold it, for a peer (the coordinator after a restart) catching up to `round_`."""
        if round_ != self.global_model.params_round or shard not in self.global_model.shards:
            return None
        return self.global_model.state_payload(shard)

    def serve_payload(self, round_: int, shard: str, replica: str) -> bytes | None:
        if replica == self.peer_id:
            return self.own_payload(round_, shard)
        return self.sealer.serve(
            round_, shard, replica
        )  # rounds this anchor sealed in the coordinator's place

    async def take_part(
        self, announcement: dict, stop: asyncio.Event, restore_unsent: Callable[[], None], record: RoundRecord
    ) -> bool | None:
        """Announce, wait for the seal, apply it, and log the round (`record` completed with the sync).

        True: applied. False: it could not be applied here and θ was downloaded instead. None: stopped."""
        round_ = announcement["round"]
        sealed = await self.wait_for_seal(round_, announcement, stop)
        if sealed is None:
            return None
        try:
            included = await self.apply(*sealed)
        except RoundFailed as exc:
            log.warning("round %d: %s; catching up from the coordinator", round_, exc)
            await self.catch_up(stop)
            return False
        if not included:
            # Left out of the seal: what we sent never reached θ, so it goes back into error feedback.
            restore_unsent()
            log.info("round %d sealed without us: our payload is kept in error feedback", round_)
        apply_s, fetched, fetch_s = self.last_apply
        synced = dataclasses.replace(
            record,
            download_bytes=fetched,
            seal_wait_s=round(self.last_seal_wait_s, 3),
            apply_s=round(apply_s, 3),
            fetch_s=round(fetch_s, 3),
            included=included,
        )
        append_round(self.data_dir, synced)
        if self.metrics is not None:
            self.metrics.add_round(synced)
        return True

    async def wait_for_seal(
        self, round_: int, announcement: dict, stop: asyncio.Event
    ) -> tuple[str, dict] | None:
        """(sealer, seal) for `round_` or later, announcing until then; None when stopped.

        The coordinator seals; when it is silent (its record has expired) the lowest-id live anchor seals
        in its place, and every replica accepts that seal too."""
        waiting_since = time.monotonic()
        try:
            return await self._wait_for_seal(round_, announcement, stop, waiting_since)
        finally:
            self.last_seal_wait_s = time.monotonic() - waiting_since

    async def _wait_for_seal(
        self, round_: int, announcement: dict, stop: asyncio.Event, waiting_since: float
    ) -> tuple[str, dict] | None:
        seen: dict[str, Announcement] = {}
        announced_at = 0.0
        while not stop.is_set():
            if time.monotonic() - announced_at > ANNOUNCE_TTL_S / 3:  # (re)announce until sealed
                await self.node.store_own("announce", announcement, ANNOUNCE_TTL_S)
                announced_at = time.monotonic()
                self.node.nudge([self.coordinator], "announce", round_)
            view = await self.view.get()
            anchors = sorted(p for p, r in view.peers.items() if r["role"] == "anchor")
            stand_in = anchors[0] if anchors and self.coordinator not in view.peers else None
            seals = await self.node.read_field("seal")
            for sealer in (self.coordinator, stand_in):
                entry = seals.get(sealer) if sealer else None
                if (
                    entry is not None
                    and isinstance(entry.value, dict)
                    and entry.value.get("round", -1) >= round_
                ):
                    return sealer, entry.value
            silent_for = time.monotonic() - waiting_since
            if (
                self.may_stand_in
                and stand_in == self.peer_id
                and silent_for > self.config.network.record_ttl_s
            ):
                expected = self.sealer.waiting_for(view.expected_contributors(round_))
                await self.sealer.collect(round_, seen)
                if seal_now(expected, seen, time.monotonic(), self.sealer.deadline.seconds):
                    log.warning("round %d: the coordinator is silent; sealing in its place", round_)
                    sealed = await self.sealer.seal(round_, seen)
                    if sealed is not None:
                        self.sealer.observe_arrivals(expected, seen)
                        return self.peer_id, sealed.record
            if await sleep_or_wake(stop, self._sealed, POLL_S):
                return None
        return None

    async def apply(self, sealer: str, seal: dict) -> bool:
        """Apply a sealed round to θ; True when our own contribution is in it. RoundFailed otherwise."""
        round_ = seal["round"]
        if round_ != self.global_model.params_round + 1:
            raise RoundFailed(
                f"the seal is for round {round_}, we hold round {self.global_model.params_round}"
            )
        max_bytes = int(self.config.network.max_frame_mb * 2**20)
        started = time.monotonic()
        wanted = [
            (c["peer"], shard, digest) for c in seal["contributions"] for shard, digest in c["shards"].items()
        ]
        # our own payloads, or all of a round we sealed, are here; the rest come from the sealer
        held = {
            (peer, shard): data
            for peer, shard, _ in wanted
            if (peer == self.peer_id or sealer == self.peer_id)
            and (data := self.serve_payload(round_, shard, peer)) is not None
        }
        remote = [(shard, peer) for peer, shard, _ in wanted if (peer, shard) not in held]
        fetched, fetch_s = 0, 0.0
        if remote:
            try:
                payloads = await self.node.fetch_payloads(sealer, round_, remote, max_bytes)
            except PeerRequestError as exc:
                raise RoundFailed(f"cannot fetch round {round_}'s payloads from the sealer: {exc}") from None
            fetched, fetch_s = sum(len(data) for data in payloads), time.monotonic() - started
            held.update({(peer, shard): data for (shard, peer), data in zip(remote, payloads, strict=True)})
        by_peer: dict[str, dict[str, bytes]] = {}
        for peer, shard, digest in wanted:
            data = held[(peer, shard)]
            if sha256_hex(data) != digest:
                raise RoundFailed(f"{peer[-8:]}'s shard {shard} does not match the sealed digest")
            by_peer.setdefault(peer, {})[shard] = data
        contributions = list(by_peer.items())
        try:
            await asyncio.to_thread(self.global_model.apply, round_, contributions)
        except WireError as exc:
            raise RoundFailed(f"a sealed payload is invalid: {exc}") from None
        self.last_apply = (time.monotonic() - started, fetched, fetch_s)
        # no digest here: hashing all of θ costs as much as the step; the record publishes the digests
        log.info("round %d applied: %d contributions, %d bytes fetched", round_, len(contributions), fetched)
        return any(peer == self.peer_id for peer, _ in contributions)

    async def catch_up(self, stop: asyncio.Event) -> bool:
        """If the swarm has sealed rounds we do not hold, download θ from the coordinator.

        True when θ was replaced (local training state built on the old θ is then stale)."""
        while not stop.is_set():
            seal = await read_seal(self.node, self.coordinator)
            if seal is None or seal["round"] <= self.global_model.params_round:
                return False  # nothing sealed yet, or we hold that θ (or newer: a coordinator restarting)
            record = (await SwarmView.read(self.node, self.config)).peers.get(self.coordinator, {})
            digests = record.get("layer_digests") if record.get("params_round") == seal["round"] else None
            try:
                await fetch_state(self.node, self.coordinator, self.global_model, seal["round"], digests)
                log.info("caught up: holding θ after round %d", self.global_model.params_round)
                return True
            except (PeerRequestError, WireError) as exc:
                log.info("catch-up to round %d not ready (%s); retrying", seal["round"], exc)
            if await sleep_or_stop(stop, 1.0):
                return False
        return False
