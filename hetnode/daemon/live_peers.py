"""Who may ask this daemon for a bandwidth probe: peers with a live, valid record in the run (TRUST §5).

A probe reply is megabytes for a request of a few dozen bytes; served to anyone it amplifies traffic
×80,000 for whoever spoofs a victim. A volunteer publishes its record before it measures, so members are
known by the time they probe; the set is refreshed every heartbeat.
"""

from __future__ import annotations

import asyncio
import logging

from hetnode.config import Config
from hetnode.daemon.lifecycle import sleep_or_stop
from hetnode.daemon.view import SwarmView
from hetnode.net.node import SwarmNode

log = logging.getLogger(__name__)


class LivePeers:
    def __init__(self, node: SwarmNode, config: Config) -> None:
        self.node = node
        self.config = config
        self.ids: frozenset[str] = frozenset()

    def allows(self, peer: str) -> bool:
        return peer in self.ids

    async def refresh(self) -> None:
        view = await SwarmView.read(self.node, self.config)
        self.ids = frozenset(view.peers)

    async def follow(self, stop: asyncio.Event) -> None:
        """Serve probes to live members only, from now until `stop`."""
        self.node.set_probe_policy(self.allows)
        while True:
            try:
                await self.refresh()
            except Exception as exc:  # a failed read keeps the last set: the next heartbeat tries again
                log.debug("reading the live peers failed: %r", exc)
            if await sleep_or_stop(stop, self.config.network.heartbeat_s):
                return
