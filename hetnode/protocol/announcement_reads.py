"""A round's announcements by two paths: the DHT's `announce` key, and the entry pulled straight from an
author that nudges the sealer, whatever the DHT does with it, so nodes with chosen ids next to the run's
keys cannot hide announcements from the sealer."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

from hetnode.net.node import StoredValue, SwarmNode

MAX_DIRECT = 10_000  # announcements pulled from their authors and kept (this round's and the last)
MAX_PULLS = 64  # direct pulls in flight at once


class AnnouncementReader:
    def __init__(self, node: SwarmNode) -> None:
        self.node = node
        self.direct: dict[str, StoredValue] = {}  # announcements pulled from their authors
        self._pulling: set[str] = set()

    def pull(self, peer: str, then: Callable[[], None] = lambda: None) -> None:
        """Take `peer`'s announcement straight from it (in the background, then call `then`); one pull per
        peer at a time, at most MAX_PULLS at once."""
        if peer in self._pulling or len(self._pulling) >= MAX_PULLS:
            return
        self._pulling.add(peer)

        async def pull() -> None:
            try:
                entry = await self.node.read_direct(peer, "announce")
                if entry is not None:
                    if len(self.direct) >= MAX_DIRECT:
                        self.direct.clear()
                    self.direct[peer] = entry
                    then()
            finally:
                self._pulling.discard(peer)

        task = asyncio.create_task(pull(), name=f"pull-announce-{peer[-8:]}")
        task.add_done_callback(lambda done: done.cancelled() or done.exception())

    async def read(self, round_: int) -> dict[str, StoredValue]:
        """Round `round_`'s view of every author's announcement: the DHT's, or the one pulled from the author
        when that is newer (the DHT may have lost or hidden it)."""
        entries = await self.node.read_field("announce")
        now = time.time()
        for peer, entry in list(self.direct.items()):
            if entry.expiration < now or entry.value.get("round", -1) < round_ - 1:
                del self.direct[peer]  # rounds gone by
                continue
            held = entries.get(peer)
            if held is None or held.value.get("round", -1) < entry.value["round"]:
                entries[peer] = entry
        return entries
