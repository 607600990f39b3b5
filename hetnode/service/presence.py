"""A daemon's own record in the DHT: published on every change and refreshed by a heartbeat, so that it
expires a few heartbeats after the daemon vanishes.

While the record's role fields stay the same the heartbeat stretches (`Cadence`), up to the stable swarm's
heartbeat, and the record lives correspondingly longer: a stable swarm of N peers then stores N records a
minute instead of N every ten seconds, and the key's replicas, which take every store, carry that much less.
A role change is published at once and brings the heartbeat back to its base."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable
from typing import Any, TypeVar

from hetnode.net.node import SwarmNode
from hetnode.net.records import MAX_TTL_S, NO_CHAIN
from hetnode.service.lifecycle import sleep_or_stop, sleep_or_wake

log = logging.getLogger(__name__)

RECORD_VERSION = 1
# the fields whose change is an event for the swarm (roles, chains, links); the per-round ones are not
EVENT_FIELDS = (
    "role",
    "wants",
    "chain",
    "stage",
    "layers",
    "chain_layout",
    "chain_lineage",
    "chain_broken",
    "chain_blame",
    "chain_noshows",
    "link_class",
    "admission",
)
STABLE_STEPS = 3  # unchanged periods at one cadence before it doubles
RETRY_S = 2.0  # after a store no DHT node accepted: try again this soon, not a stretched heartbeat later

T = TypeVar("T")


class Cadence:
    """A period that doubles after every STABLE_STEPS unchanged observations, from `base_s` up to
    `stable_s`, and is back at `base_s` on any change."""

    def __init__(self, base_s: float, stable_s: float) -> None:
        self.base_s = base_s
        self.stable_s = max(base_s, stable_s)
        self.unchanged = 0

    @property
    def period_s(self) -> float:
        return min(self.stable_s, self.base_s * 2 ** (self.unchanged // STABLE_STEPS))

    def observe(self, changed: bool) -> None:
        self.unchanged = 0 if changed else self.unchanged + 1


class Presence:
    def __init__(
        self,
        node: SwarmNode,
        record: dict[str, Any],
        heartbeat_s: float,
        ttl_s: float,
        stable_heartbeat_s: float | None = None,
    ) -> None:
        self.node = node
        self.record = dict(record, version=RECORD_VERSION)
        self.cadence = Cadence(heartbeat_s, stable_heartbeat_s or heartbeat_s)
        self.ttl_s = ttl_s
        self._lock = asyncio.Lock()
        self._changed = asyncio.Event()
        self._expires = 0.0  # of our last accepted store
        self._published_events: tuple = ()
        self._events = 0  # publishes that changed a role field
        self.stored = False  # whether our last store was accepted

    @property
    def heartbeat_s(self) -> float:
        return self.cadence.period_s

    async def update(self, **changes: Any) -> bool:
        self.record.update(changes)
        return await self.publish()

    async def publish(self) -> bool:
        async with self._lock:
            events = tuple(self.record.get(field) for field in EVENT_FIELDS)
            if events != self._published_events:
                self.cadence.observe(changed=True)
                self._events += 1
                self._changed.set()  # the heartbeat loop starts over at its base
            self._published_events = events
            now = time.time()
            self.record["last_seen"] = now
            # lives as many heartbeats as at the base cadence, within the field's cap (every DHT node
            # refuses a longer-lived record); never shorter than what is stored already, which a DHT node
            # would refuse as older than its copy
            stretched = min(self.ttl_s * self.cadence.period_s / self.cadence.base_s, MAX_TTL_S["peers"])
            # an absolute expiry, strictly later than the stored one's (a TTL would be counted from a
            # moment a little later or sooner than the last store's)
            expires_at = max(now + stretched, self._expires + 1e-3)
            stored = await self.node.store_own("peers", dict(self.record), stretched, expires_at=expires_at)
            if stored:
                self._expires = expires_at
            self.stored = stored
        if not stored:
            log.warning(
                "no DHT node accepted our record (role %s); retrying in %.0f s",
                self.record["role"],
                min(RETRY_S, self.cadence.period_s),
            )
        return stored

    async def heartbeat(self, stop: asyncio.Event) -> None:
        await self.publish()
        self._changed.clear()  # that first store was the change: nothing to store again at once
        while True:
            events = self._events
            retrying = not self.stored
            wait = min(RETRY_S, self.cadence.period_s) if retrying else self.cadence.period_s
            if await sleep_or_wake(stop, self._changed, wait):
                return
            if self._events != events:  # `update` just published a change: sleep again, at the base
                continue
            if not retrying:  # a failed store does not count as a stable period
                self.cadence.observe(changed=False)  # before publishing: the record lives for the next one
            await self.publish()

    async def beating(self, work: Awaitable[T]) -> T:
        """`work`, awaited while a heartbeat keeps our record alive: start-up work that may take longer
        than a record lives (building a big model), before the daemon's own heartbeat task is running."""
        done = asyncio.Event()
        beat = asyncio.create_task(self.heartbeat(done), name="heartbeat while starting")
        try:
            return await work
        finally:
            done.set()
            await beat

    async def announce_offline(self) -> None:
        try:
            offline = {"role": "offline", **NO_CHAIN}
            await asyncio.wait_for(self.update(**offline), 5.0)
        except Exception as exc:  # shutting down: the record will expire anyway
            log.debug("offline announcement failed: %r", exc)


async def keep_in_dht(node: SwarmNode, stop: asyncio.Event, period_s: float) -> None:
    """Every `period_s` until `stop`: note our DHT neighbours, and rejoin through contacts or remembered
    neighbours when an outage has left none (`SwarmNode.rejoin_dht`)."""
    while True:
        try:
            await node.check_dht_membership()
        except Exception as exc:  # a failed attempt is retried at the next period
            log.debug("rejoin attempt failed: %r", exc)
        if await sleep_or_stop(stop, period_s):
            return
