"""The swarm as one peer's DHT reads show it: validated peer records, claims, chains, the status document."""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import math
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from hetnode.config import Config
from hetnode.net.node import StoredValue, SwarmNode
from hetnode.net.records import check_head_record, check_peer_record
from hetnode.planning.roles import Candidate, ChainStatus, Claim, chain_prefix, chain_status, parse_layout
from hetnode.protocol.view_changes import Step, apply_steps
from hetnode.service.lifecycle import sleep_or_wake
from hetnode.service.presence import Cadence

log = logging.getLogger(__name__)

ROLE_ORDER = {"coordinator": 0, "anchor": 1, "stage": 2, "idle": 3}
MAX_DIRECT_RECORDS = 10_000  # records taken straight from their peers and kept (the DHT hid them)
MAX_RECORD_PULLS = 64  # such pulls in flight at once


@dataclass(frozen=True)
class SwarmView:
    peers: dict[str, dict[str, Any]]  # peer id -> record (offline peers left out)
    stages_per_chain: int
    n_layers: int
    departed: set[str] = field(default_factory=set)  # peers whose record says they went offline

    @classmethod
    def from_entries(
        cls, entries: Mapping[str, StoredValue], stages_per_chain: int, n_layers: int
    ) -> SwarmView:
        view = cls({}, stages_per_chain, n_layers)
        for peer_id, entry in entries.items():
            record = view.admit(peer_id, entry.value)
            if record is not None:
                view.peers[peer_id] = record
            elif isinstance(entry.value, dict) and entry.value.get("role") == "offline":
                view.departed.add(peer_id)
        return view

    def admit(self, peer_id: str, value: Any) -> dict[str, Any] | None:
        """`value` as a record of this view (schema and model checked again), or None when it cannot be one
        or says the peer is offline."""
        try:
            record = check_peer_record(value)
        except Exception as exc:  # a relay passed on something our schema refuses
            log.debug("ignoring the record of peer %s: %s", peer_id, exc)
            return None
        shards = {"embed", "head", *(str(i) for i in range(self.n_layers))}
        problem = _model_problem(record, shards, self.n_layers)
        if problem:  # schema-valid, but not about this run's model: keys limited to its shards
            log.debug("ignoring the record of peer %s: %s", peer_id, problem)
            return None
        return record if record["role"] != "offline" else None

    @classmethod
    async def read(cls, node: SwarmNode, config: Config) -> SwarmView:
        """The current view through `node`: every fresh, valid peer record of the run."""
        return cls.from_entries(await node.read_field("peers"), config.pipeline.stages, config.model.n_layers)

    def idle_candidates(self, boundary: int) -> list[Candidate]:
        """The pool at `boundary`: idle stage candidates, plus those that already claimed a chain formed at
        this boundary (peers read the pool at slightly different times; a quick claimer is still in it)."""
        prefix = chain_prefix(boundary)
        return [
            Candidate(peer_id, record["tflops"])
            for peer_id, record in self.peers.items()
            if record["wants"] == "stage"
            and (
                record["role"] == "idle"
                or (record["role"] == "stage" and (record["chain"] or "").startswith(prefix))
            )
        ]

    def claims(self) -> list[Claim]:
        return [
            Claim(
                peer_id,
                record["chain"],
                record["stage"],
                tuple(record["layers"]),
                parse_layout(record.get("chain_layout") or []),
            )
            for peer_id, record in self.peers.items()
            if record["role"] == "stage"
            and record["chain"]
            and record["stage"] is not None
            and record["layers"]
        ]

    def chains(self) -> list[ChainStatus]:
        return chain_status(self.claims(), self.stages_per_chain, self.n_layers)

    def chain_is_live(self, chain: str) -> bool:
        return any(c.chain == chain and c.live for c in self.chains())

    def expected_contributors(self, round_: int, overlap: bool = False) -> set[str]:
        """Whom a seal of `round_` waits for: every anchor, and every member of a live chain that holds θ
        after round_−1 (a chain still forming or catching up is not waited for; it joins a later round).
        With `overlap` a member may still be applying round_−1 while it trains round_ (at most one round
        unapplied): θ after round_−2 will do."""
        live = {c.chain for c in self.chains() if c.live}
        oldest = round_ - (2 if overlap else 1)
        return {
            peer
            for peer, r in self.peers.items()
            if r["role"] == "anchor"
            or (
                r["role"] == "stage"
                and r["chain"] in live
                and _between(r["params_round"], oldest, round_ - 1)
            )
        }

    def signature(self) -> frozenset:
        """Who is in the swarm in which role: what a change of makes the swarm unstable (not the
        per-round fields, which change every round)."""
        return frozenset(
            (peer, r["role"], r["wants"], r["chain"], r["stage"], tuple(r["layers"] or ()))
            for peer, r in self.peers.items()
        )

    def digest(self) -> str:
        """16 hex digits over what the swarm's decisions read from the records (who is in it, in which role
        and chain, with which links and compute), not the per-round fields: equal digests, equal decisions.
        The coordinator publishes its view's in its `head` entry (`PeerDirectory`)."""
        rows = sorted(self.row(peer) for peer in self.peers)
        text = json.dumps(rows, separators=(",", ":"), default=str)
        return hashlib.sha256(text.encode()).hexdigest()[:16]

    def row(self, peer: str) -> list[Any]:
        """What `digest` reads from one peer's record: a change of it is a change of the view."""
        r = self.peers[peer]
        return [
            peer,
            r["role"],
            r["wants"],
            r["chain"],
            r["stage"],
            r["layers"],
            r.get("chain_layout"),
            r["link_class"],
            r["tflops"],
        ]

    def status_document(self, run: str, round_: int) -> dict[str, Any]:
        """The stable `hetnode status --json` document (later versions add fields, never rename)."""
        peers = [
            {
                "peer_id": peer_id,
                "name": r["name"],
                "class": r["link_class"],
                "role": r["role"],
                "chain": r["chain"],
                "stage": r["stage"],
                "layers": r["layers"],
                "up_mbps": r["up_mbps"],
                "down_mbps": r["down_mbps"],
                "rtt_ms": r["rtt_ms"],
                "tflops": r["tflops"],
                "last_seen": r["last_seen"],
                "params_round": r["params_round"],
                "layer_digests": r["layer_digests"],
                "tokens": r["tokens"],
                "utilization": r.get("utilization"),
            }
            for peer_id, r in self.peers.items()
        ]
        peers.sort(
            key=lambda p: (
                ROLE_ORDER.get(p["role"], 9),
                p["chain"] or "",
                p["stage"] or 0,
                p["name"],
                p["peer_id"],
            )
        )
        chains = [
            {"id": c.chain, "live": c.live, "stages": list(c.stages), "problem": c.problem}
            for c in self.chains()
        ]
        # "round" kept as it was named first; "boundary_round" says what it counts (not a sync round)
        return {"run": run, "round": round_, "boundary_round": round_, "peers": peers, "chains": chains}


def _model_problem(record: dict[str, Any], shards: set[str], n_layers: int) -> str:
    """Why a schema-valid record cannot be about this run's model ("" when it can)."""
    digests = record.get("layer_digests") or {}
    if not set(digests) <= shards:
        return f"layer_digests name shards the model does not have: {sorted(set(digests) - shards)[:3]}"
    layers = record.get("layers")
    if layers is not None and not 0 <= layers[0] <= layers[1] < n_layers:
        return f"layers {layers} outside 0..{n_layers - 1}"
    if len(record.get("chain_layout") or ()) > 64:
        return "a chain layout longer than any chain"
    return ""


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
    would hide records (TRUST §5). `heard_from(peer)` (the coordinator calls it when a replica nudges it)
    asks a peer the last full read did not show for its record directly, and every view is built from the
    DHT's records and those: a replica in touch with the coordinator is in its view, so its seal waits for
    it.

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
        return SwarmView.from_entries(entries, self.config.pipeline.stages, self.config.model.n_layers)

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


def _between(value: object, low: int, high: int) -> bool:
    return isinstance(value, int) and low <= value <= high
