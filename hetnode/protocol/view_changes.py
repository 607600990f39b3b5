"""The coordinator's change log: its view's recent transitions, so that a replica one or a few changes
behind applies them instead of reading every peer record again (`PeerDirectory`).

Each step goes from one view digest to the next and holds the records (as the coordinator read and
validated them) of the peers whose decision fields (`SwarmView.row`) differ: added, changed, or None for a
peer that left. A reader takes only the coordinator's entry, checks every record again as a full read
would, and adopts the result only when its digest is the one the coordinator's head names: a log that is
wrong, stale or incomplete costs the reader a full read, never a wrong view.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from hetnode.net.records import (
    MAX_CHANGE_STEPS,
    MAX_RECORD_BYTES,
    MAX_STEP_PEERS,
    check_changes_record,
    new_changes_record,
    value_bytes,
)

if TYPE_CHECKING:
    from hetnode.net.node import SwarmNode
    from hetnode.protocol.swarm_view import SwarmView

log = logging.getLogger(__name__)

Step = dict[str, Any]  # {"from": digest, "to": digest, "peers": {peer: record | None}}


def new_step(before: SwarmView, after: SwarmView, max_peers: int = MAX_STEP_PEERS) -> Step | None:
    """The step from `before` to `after`, or None when more than `max_peers` peers differ (a reader is
    better off reading every record than a log that names most of them)."""
    peers: dict[str, dict[str, Any] | None] = {
        peer: None for peer in before.peers.keys() - after.peers.keys()
    }
    for peer, record in after.peers.items():
        if peer not in before.peers or before.row(peer) != after.row(peer):
            peers[peer] = record
    if len(peers) > max_peers:
        return None
    return {"from": before.digest(), "to": after.digest(), "peers": peers}


def trim_steps(
    steps: list[Step], keep: int = MAX_CHANGE_STEPS, max_bytes: int = MAX_RECORD_BYTES["changes"]
) -> list[Step]:
    """The newest `keep` of `steps`, fewer while their entry weighs more than `max_bytes`; none when the
    newest alone does not fit."""
    steps = steps[-keep:] if keep > 0 else []
    while steps and value_bytes(new_changes_record(steps)) > max_bytes:
        steps = steps[1:]
    return steps


def step_chain(steps: list[Step], ours: str, theirs: str) -> list[Step] | None:
    """The consecutive steps that lead from digest `ours` to digest `theirs` (the latest such run) or None."""
    for start in reversed(range(len(steps))):
        if steps[start]["from"] != ours:
            continue
        chain: list[Step] = []
        for step in steps[start:]:
            if chain and step["from"] != chain[-1]["to"]:
                break
            chain.append(step)
            if step["to"] == theirs:
                return chain
    return None


def apply_steps(
    view: SwarmView,
    steps: list[Step],
    theirs: str,
    is_member: Callable[[str], bool] = lambda peer: True,
) -> SwarmView | None:
    """`view` moved along the coordinator's `steps` to the view of digest `theirs`, every record checked
    again as a full read checks it; None when no chain leads there or the result's digest is not `theirs`."""
    chain = step_chain(steps, view.digest(), theirs)
    if chain is None:
        return None
    peers = dict(view.peers)
    for step in chain:
        for peer, value in step["peers"].items():
            record = view.admit(peer, value) if value is not None and is_member(peer) else None
            if record is None:  # left, or a record we refuse: the digest check below decides
                peers.pop(peer, None)
            else:
                peers[peer] = record
    moved = replace(view, peers=peers)
    return moved if moved.digest() == theirs else None


async def coordinator_changes(node: SwarmNode, coordinator: str, fresh_s: float) -> list[Step] | None:
    """The steps of the coordinator's `changes` entry (the first copy found), or None when it is missing,
    refused by our schema, or was stored more than `fresh_s` ago by the coordinator's clock."""
    changes = await node.read_entry("changes", coordinator, check_changes_record, latest=False)
    if changes is None:
        return None
    if time.time() - changes["at"] > fresh_s:
        log.debug("ignoring the coordinator's changes entry: stored %.0f s ago", time.time() - changes["at"])
        return None
    return changes["steps"]


class ChangeLog:
    """The coordinator's side: `record` each transition of its view as it happens, `publish` the log before
    any head that names the new digest (a replica that sees the digest must find the step)."""

    def __init__(self, node: SwarmNode, ttl_s: float) -> None:
        self.node = node
        self.ttl_s = ttl_s
        self.steps: list[Step] = []
        self._pending = False

    def record(self, before: SwarmView | None, after: SwarmView) -> None:
        if before is None:  # our first read: no digest to go from
            return
        step = new_step(before, after)
        # a change too large to log restarts the log: readers behind it read every record
        self.steps = trim_steps([*self.steps, step]) if step is not None else []
        self._pending = True

    async def publish(self) -> None:
        """Store the log if it changed since the last store (a refused store is tried again next time)."""
        if not self._pending:
            return
        self._pending = False
        if not await self.node.store_own("changes", new_changes_record(self.steps), self.ttl_s):
            self._pending = True
            log.warning("the DHT did not accept our changes entry")
