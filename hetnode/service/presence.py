"""A daemon's own record in the DHT: published on every change and refreshed by a heartbeat, so that it
expires about `ttl_s` after the daemon vanishes."""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

from hetnode.net.node import SwarmNode
from hetnode.service.lifecycle import sleep_or_stop

log = logging.getLogger(__name__)

RECORD_VERSION = 1


class Presence:
    def __init__(self, node: SwarmNode, record: dict[str, Any], heartbeat_s: float, ttl_s: float) -> None:
        self.node = node
        self.record = dict(record, version=RECORD_VERSION)
        self.heartbeat_s = heartbeat_s
        self.ttl_s = ttl_s
        self._lock = asyncio.Lock()

    async def update(self, **changes: Any) -> bool:
        self.record.update(changes)
        return await self.publish()

    async def publish(self) -> bool:
        async with self._lock:
            self.record["last_seen"] = time.time()
            stored = await self.node.store_own("peers", dict(self.record), self.ttl_s)
        if not stored:
            log.warning(
                "no DHT node accepted our record (role %s); retrying at the next heartbeat",
                self.record["role"],
            )
        return stored

    async def heartbeat(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            await self.publish()
            await sleep_or_stop(stop, self.heartbeat_s)

    async def announce_offline(self) -> None:
        try:
            offline = {"role": "offline", "chain": None, "stage": None, "layers": None, "chain_layout": None}
            await asyncio.wait_for(self.update(**offline), 5.0)
        except Exception as exc:  # shutting down: the record will expire anyway
            log.debug("offline announcement failed: %r", exc)
