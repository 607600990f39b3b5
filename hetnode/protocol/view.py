"""The peer records as one daemon reads them (`PeerDirectory`), and the coordinator's digest of its own
read (`coordinator_directory`). The view they make is `swarm_view.SwarmView`."""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Awaitable, Callable, Mapping

from hetnode.config import Config
from hetnode.net.node import StoredValue, SwarmNode
from hetnode.net.records import check_head_record
from hetnode.protocol.swarm_view import SwarmView
from hetnode.protocol.view_changes import Step, apply_steps
from hetnode.service.lifecycle import sleep_or_wake
from hetnode.service.presence import Cadence

log = logging.getLogger(__name__)

MAX_DIRECT_RECORDS = 10_000  # records taken straight from their peers and kept (the DHT hid them)
MAX_RECORD_PULLS = 64  # such pulls in flight at once


async def coordinator_directory(node: SwarmNode, coordinator: str, fresh_s: float) -> str | None:
    """The digest of the coordinator's view of the swarm from its `head` entry (one small entry, the first
    copy found), or None when the entry is missing, refused by our schema, has no digest, or was stored more
    than `fresh_s` ago by the coordinator's clock (a coordinator that went silent must not vouch for a view
    it no longer reads)."""
    head = await node.read_entry("head", coordinator, check_head_record, latest=False)
    if (
        head is None
        or head.get("directory") is None
        or head.get("at") is None
        or time.time() - head["at"] > fresh_s
    ):
        return None
    return head["directory"]


class PeerDirectory:
    """The peer records as one daemon reads them: one read shared by everything in the daemon that needs
    them, repeated every `base_s` while the swarm's roles and membership change and less often, up to
    `stable_s`, while they do not. `wake()` (an event: a boundary, a stranger's request) brings the next
    read forward, never more often than every `base_s`, and makes it a full read.

    A read moves every record of the swarm, so a peer's cost of following it grows with the swarm. With
    `vouched` (a replica's: the digest the coordinator's `head` entry publishes), a refresh first reads
    that one small entry, and reads the records only when the coordinator's view differs from ours: in a
    stable swarm a peer reads them once. With `changes` too (the steps of the coordinator's change log), a
    view one or a few changes behind takes just the records that changed (`view_changes.apply_steps`) and
    reads every record only when the log does not lead to the coordinator's digest. `wake()` and
    `get(max_age_s=0)` always read them.

    The DHT is one path, not the only one: nodes with chosen ids next to the `peers` key that keep nothing
    would hide records (docs/security.md, "Exhaust a daemon"). `heard_from(peer)` (the coordinator calls it
    when a replica nudges it) asks a peer the last full read did not show for its record directly, and every
    view is built from the DHT's records and those: a replica in touch with the coordinator is in its view, so
    its seal waits for it.

    `on_read` gets every full read's raw entries, members or not (the membership policy is built from them);
    `on_change` gets the previous view (None before the first) and the new one whenever the digest changes."""

    def __init__(
        self,
        node: SwarmNode,
        config: Config,
        base_s: float,
        stable_s: float,
        on_read: Callable[[Mapping[str, StoredValue]], None] | None = None,
        is_member: Callable[[str], bool] = lambda peer: True,
        vouched: Callable[[], Awaitable[str | None]] | None = None,
        on_change: Callable[[SwarmView | None, SwarmView], None] = lambda before, after: None,
        changes: Callable[[], Awaitable[list[Step] | None]] | None = None,
    ) -> None:
        self.node = node
        self.config = config
        self.cadence = Cadence(base_s, stable_s)
        self.on_read = on_read
        self.is_member = is_member
        self.vouched = vouched
        self.changes = changes
        self.on_change = on_change  # after a refresh whose view's digest differs from the last one's
        self.digest: str | None = None  # of the last read's view
        self.reads = 0  # reads of every record
        self.vouched_refreshes = 0  # refreshes the coordinator's digest answered without such a read
        self.delta_refreshes = 0  # refreshes the coordinator's change log brought up to its digest
        self._view: SwarmView | None = None
        self._read_at = -math.inf
        self._signature: frozenset = frozenset()
        self._full_read_due = False
        self._reading = False
        self._lock = asyncio.Lock()
        self._woken = asyncio.Event()
        self._read_entries: dict[str, StoredValue] = {}  # members by the full reads, unexpired
        self._in_last_read: set[str] = set()  # members the last full read found in the DHT
        self._direct: dict[str, tuple[float, StoredValue]] = {}  # peer -> (taken at, its record)
        self._pulling: set[str] = set()

    async def get(self, max_age_s: float | None = None) -> SwarmView:
        """The view, refreshed when older than `max_age_s` (default: the current period); `max_age_s=0`
        reads every record now."""
        limit = self.cadence.period_s if max_age_s is None else max_age_s
        async with self._lock:  # callers at the same moment share one read
            stale = self._view is None or time.monotonic() - self._read_at > limit
            if stale and (max_age_s == 0 or not await self._vouched_for()):
                await self._read()
        assert self._view is not None
        return self._view

    async def _vouched_for(self) -> bool:
        """True (and the view counts as fresh) when the coordinator's published digest is our view's, or
        its change log brought our view to that digest."""
        if self.vouched is None or self._view is None or self._full_read_due:
            return False
        try:
            theirs = await self.vouched()
        except Exception as exc:  # no answer is no vouching: read the records
            log.debug("reading the coordinator's view digest failed: %r", exc)
            return False
        if theirs is None:
            return False
        if theirs != self.digest:
            return await self._follow_changes(theirs)
        self.cadence.observe(changed=False)
        self._read_at = time.monotonic()
        self.vouched_refreshes += 1
        return True

    async def _follow_changes(self, theirs: str) -> bool:
        """Apply the coordinator's steps from our digest to `theirs`; False (read every record) when there
        are none, they do not chain from our view, or their result is not the view `theirs` names."""
        if self.changes is None or self._view is None:
            return False
        try:
            steps = await self.changes()
        except Exception as exc:
            log.debug("reading the coordinator's change log failed: %r", exc)
            return False
        if steps is None:
            log.debug("no fresh change log of the coordinator: reading every record")
            return False
        self._reading = True  # a peer we do not know yet sends us to a full read anyway, not to a wake
        try:
            view = apply_steps(self._view, steps, theirs, self.is_member)
        finally:
            self._reading = False
        if view is None:
            log.debug("the coordinator's change log does not lead from %s to %s", self.digest, theirs)
            return False
        self._adopt(view)
        self.delta_refreshes += 1
        return True

    async def _read(self) -> None:
        entries = await self.node.read_field("peers", members_only=False)
        self._reading = True  # a non-member's records are no event: every read would meet them again
        try:
            if self.on_read is not None:
                self.on_read(entries)
            members = {peer: entry for peer, entry in entries.items() if self.is_member(peer)}
        finally:
            self._reading = False
        self._full_read_due = False
        self.reads += 1
        # an entry is valid until it expires: one missing from this read before then was hidden, not
        # withdrawn (a leaving peer stores an offline record), and stays
        now = time.time()
        kept = {
            p: e
            for p, e in self._read_entries.items()
            if p not in members and e.expiration > now and self.is_member(p)
        }
        self._in_last_read = set(members)
        self._read_entries = members | kept
        self._adopt(self._from_records())

    def _from_records(self) -> SwarmView:
        """The view of the full reads' records and, where they have none or an older one, the records
        taken directly (unexpired)."""
        entries = dict(self._read_entries)
        now = time.time()
        for peer, (_, entry) in list(self._direct.items()):
            if entry.expiration < now or not self.is_member(peer):
                del self._direct[peer]
            elif peer not in entries or entries[peer].expiration < entry.expiration:
                entries[peer] = entry
        p = self.config.pipeline
        return SwarmView.from_entries(entries, p.stages, self.config.model.n_layers, p.stage_workers)

    def heard_from(self, peer: str) -> None:
        """`peer` spoke to us directly: when the last full read found no record of it, take its record
        from it (in the background, at most once per `base_s` each); it is in the next view, and in ours at
        once when it was not yet. Strangers gain nothing by it that storing a record would not give them."""
        if peer in self._in_last_read or peer in self._pulling or len(self._pulling) >= MAX_RECORD_PULLS:
            return
        taken = self._direct.get(peer)
        if taken is not None and time.monotonic() - taken[0] < self.cadence.base_s:
            return
        self._pulling.add(peer)

        async def pull() -> None:
            try:
                entry = await self.node.read_direct(peer, "peers")
                if entry is None or not self.is_member(peer):
                    return
                if len(self._direct) >= MAX_DIRECT_RECORDS:
                    self._direct.clear()
                self._direct[peer] = (time.monotonic(), entry)
                # a replica's view may be the coordinator's log applied to a read: it takes the record
                # at its next full read
                if self.vouched is None and self._view is not None and peer not in self._view.peers:
                    log.info("peer %s: its record came directly (the DHT showed none)", peer)
                    self._adopt(self._from_records())
            finally:
                self._pulling.discard(peer)

        task = asyncio.create_task(pull(), name=f"pull-record-{peer[-8:]}")
        task.add_done_callback(lambda done: done.cancelled() or done.exception())

    def _adopt(self, view: SwarmView) -> None:
        signature, digest = view.signature(), view.digest()
        self.cadence.observe(changed=signature != self._signature)
        before, changed = self._view, digest != self.digest
        self._view, self._signature, self._read_at, self.digest = view, signature, time.monotonic(), digest
        if changed:
            self.on_change(before, view)

    def wake(self) -> None:
        self.cadence.observe(changed=True)
        if not self._reading:
            self._full_read_due = True  # a stranger the coordinator may not have seen yet
        self._woken.set()

    async def follow(self, stop: asyncio.Event) -> None:
        """Keep the view (and what `on_read` derives from it) current until `stop`."""
        while True:
            try:
                await self.get(max_age_s=self.cadence.base_s)
            except Exception as exc:  # a failed read keeps the last view: the next period tries again
                log.debug("reading the peer records failed: %r", exc)
            if await sleep_or_wake(stop, self._woken, self.cadence.period_s):
                return
