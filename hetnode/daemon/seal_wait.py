"""A replica's wait for the seal of a round (`RoundParticipant.wait_for_seal`), and the small reads of the
sealer's DHT entries it and the participant's checks make.

While it waits, the replica re-announces its payload and looks for the seal: the sealer nudges it, and a poll
is the fallback. A poll reads the coordinator's `head` entry, one small record, before the seal, which grows
with the swarm. Who may seal (docs/security.md, "Who is trusted with what"): the coordinator, or, while its
record has expired, the lowest-id live stand-in the signed manifest lists; when that stand-in is this replica
it seals in the coordinator's place. A seal is taken only as the next link of the chain this replica holds, or
as one to catch up to (`seal_verdict`).

The DHT is one path, not the only one: when a nudge (or every 4th poll) finds no seal there, the replica
asks the sealers for it directly, so nodes with chosen ids next to the run's keys cannot hide it; the same
for the coordinator's `head`.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import Any

from hetnode.config import Config
from hetnode.net.node import SwarmNode
from hetnode.net.records import check_head_record
from hetnode.planning.rounds import Announcement
from hetnode.protocol.sealing import Sealer
from hetnode.protocol.swarm_view import SwarmView
from hetnode.protocol.view import PeerDirectory
from hetnode.replica.global_model import GlobalModel
from hetnode.service.lifecycle import sleep_or_wake
from hetnode.wire.seals import seal_verdict

log = logging.getLogger(__name__)

ANNOUNCE_TTL_S = 300.0
POLL_S = 1.0  # seals are nudged to us: polling is the fallback (a lost nudge, a stand-in sealer)
# a DHT read on the wait for a seal: longer, and the DHT counts as hiding the entry (the direct path is
# asked); nodes next to a key that answer late must not hold a replica past its round
ROUND_READ_S = 3.0


async def read_seal(node: SwarmNode, sealer: str) -> dict[str, Any] | None:
    entry = (await node.read_field("seal")).get(sealer)
    return entry.value if entry is not None and isinstance(entry.value, dict) else None


async def read_head(node: SwarmNode, coordinator: str) -> tuple[int, dict[str, str]] | None:
    """The coordinator's θ as its `head` entry states it: (round, layer digests), or None when absent."""
    head = await node.read_entry("head", coordinator, check_head_record)
    if head is None:  # hidden or lost in the DHT: ask the coordinator itself
        entry = await node.read_direct(coordinator, "head")
        head = check_head_record(entry.value) if entry is not None else None
    return (head["round"], head["layer_digests"]) if head is not None else None


async def sealed_round(node: SwarmNode, coordinator: str, latest: bool) -> int | None:
    """The newest round the coordinator sealed, as its `head` entry states it (None: no such entry, or one
    our schema refuses). A poll for a seal reads this small entry instead of the seal, which grows with
    the swarm and is the previous round's until the new one is out."""
    head = await node.read_entry("head", coordinator, check_head_record, latest=latest)
    return head.get("sealed") if head is not None else None


class SealWaiter:
    """Announce and wait for a seal an allowed sealer made for us. `stand_in(view)` is the participant's
    rule for the listed stand-in that seals now (None while the coordinator is live); `may_stand_in`:
    this replica may be that stand-in, and seals with `sealer` when it is."""

    def __init__(
        self,
        config: Config,
        node: SwarmNode,
        coordinator: str,
        global_model: GlobalModel,
        sealer: Sealer,
        view: PeerDirectory,
        stand_in: Callable[[SwarmView], str | None],
        may_stand_in: bool,
    ) -> None:
        self.config = config
        self.node = node
        self.coordinator = coordinator
        self.global_model = global_model
        self.sealer = sealer
        self.view = view
        self.stand_in = stand_in
        self.may_stand_in = may_stand_in
        self.peer_id = node.identity.peer_id
        self._sealed = asyncio.Event()  # the sealer nudged us: a seal is in the DHT
        self.nudges = 0
        self._storing: asyncio.Task | None = None  # our announcement's DHT store, in the background

    def nudged(self) -> None:
        """The sealer told us a seal is in the DHT: wake the wait."""
        self.nudges += 1
        self._sealed.set()

    async def wait(
        self, round_: int, announcement: dict | None, stop: asyncio.Event, waiting_since: float
    ) -> tuple[str, dict] | None:
        """(sealer, seal) for `round_` or later, announcing until then (None: a round sat out, nothing
        to announce); None when stopped."""
        seen: dict[str, Announcement] = {}
        announced_at = 0.0
        polls = 0
        nudged = True  # the first read looks everywhere, as does every read a nudge brings
        woken = False  # by the sealer's nudge
        while not stop.is_set():
            # (re)announce until sealed
            if announcement is not None and time.monotonic() - announced_at > ANNOUNCE_TTL_S / 3:
                # served directly and the coordinator nudged first; the DHT's store (slow when nodes
                # next to the key misbehave) runs beside the wait: it must not make us late for the seal
                expires_at = time.time() + ANNOUNCE_TTL_S
                self.node.serve_own("announce", announcement, expires_at)
                self.node.nudge([self.coordinator], "announce", round_)
                self._store_announcement(announcement, expires_at)
                announced_at = time.monotonic()
            view = await self.view.get()
            stand_in = self.stand_in(view)
            allowed = [self.coordinator] + ([stand_in] if stand_in else [])
            # unless the sealer nudged us, the coordinator's head says whether the seal is out yet
            sealed = None
            slow = False  # a DHT read ran out of time: the entry counts as hidden
            if stand_in is None and not woken:
                try:
                    sealed = await asyncio.wait_for(
                        sealed_round(self.node, self.coordinator, latest=polls % 4 == 0), ROUND_READ_S
                    )
                except TimeoutError:
                    slow = True
            if sealed is None or sealed >= round_:
                # a timed poll (a lost nudge) takes the first copy it finds, not every replica's whole
                # seal; when the head or a nudge says it is out, a stale first copy sends us everywhere
                told = woken or sealed is not None  # that the seal is out: its first copy will do
                found = None
                try:
                    found = self._seal_in(await self._read_seals(latest=nudged and not told), allowed)
                    if found is None and told:
                        found = self._seal_in(await self._read_seals(latest=True), allowed)
                except TimeoutError:
                    slow = True
                # directly only when the seal should be out (a nudge, the head), the head is hidden too or
                # the DHT is slow: not every waiting replica asking the coordinator every few polls
                if found is None and (told or slow or (sealed is None and polls % 4 == 0)):
                    found = self._seal_in(await self._direct_seals(allowed), allowed)
                if found is not None:
                    return found
            silent_for = time.monotonic() - waiting_since
            if (
                self.may_stand_in
                and stand_in == self.peer_id
                and silent_for > self.config.network.record_ttl_s
            ):
                expected = self.sealer.waiting_for(
                    view.expected_contributors(round_, self.config.outer.overlap)
                )
                await self.sealer.collect(round_, seen)
                if self.sealer.ready(expected, seen):
                    log.warning("round %d: the coordinator is silent; sealing in its place", round_)
                    sealed = await self.sealer.seal(round_, seen)
                    if sealed is not None:
                        self.sealer.observe_arrivals(expected, seen)
                        return self.peer_id, sealed.record
            # the sealer nudges us; the poll is the fallback, and a long wait (slow peers) need not
            # re-read the previous round's seal every second: it backs off to a heartbeat
            poll_s = min(max(POLL_S, self.config.network.heartbeat_s), POLL_S * 2 ** (polls // 2))
            if stand_in == self.peer_id:  # sealing in the coordinator's place: its deadline's resolution
                poll_s = POLL_S
            polls += 1
            nudges = self.nudges
            if await sleep_or_wake(stop, self._sealed, poll_s):
                return None
            woken = self.nudges != nudges
            # every 4th timed poll looks everywhere too: a replica of the key that missed the seal's store
            # must not hide it from us
            nudged = woken or stand_in is not None or polls % 4 == 0
        return None

    def _store_announcement(self, announcement: dict, expires_at: float) -> None:
        """Store our announcement in the DHT in the background, one store at a time (a store of an older
        announcement still running is dropped for this one)."""
        if self._storing is not None and not self._storing.done():
            self._storing.cancel()
        store = self.node.store_own("announce", announcement, ANNOUNCE_TTL_S, expires_at=expires_at)
        self._storing = asyncio.create_task(store, name="store-announcement")
        self._storing.add_done_callback(lambda done: done.cancelled() or done.exception())

    async def _read_seals(self, latest: bool) -> dict[str, Any]:
        """The seals in the DHT, within ROUND_READ_S (TimeoutError beyond)."""
        return await asyncio.wait_for(self.node.read_field("seal", latest=latest), ROUND_READ_S)

    async def _direct_seals(self, allowed: list[str]) -> dict[str, Any]:
        """Each allowed sealer's current seal, asked of it directly (the path beside the DHT)."""
        sealers = [sealer for sealer in allowed if sealer != self.peer_id]
        entries = await asyncio.gather(*(self.node.read_direct(sealer, "seal") for sealer in sealers))
        return {sealer: entry for sealer, entry in zip(sealers, entries, strict=True) if entry is not None}

    def _seal_in(self, seals: dict[str, Any], allowed: list[str]) -> tuple[str, dict] | None:
        """The first seal of an allowed sealer that is for us: the next link, or one to catch up to."""
        for sealer in allowed:
            entry = seals.get(sealer)
            if entry is None or not isinstance(entry.value, dict):
                continue
            verdict = seal_verdict(
                entry.value, sealer, allowed, self.global_model.params_round, self.global_model.seal_hash
            )
            # apply() takes the next link and catches up on "behind" or "fork"
            if verdict in ("apply", "behind", "fork"):
                return sealer, entry.value
        return None
