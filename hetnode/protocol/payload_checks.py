"""The seal's fetch and check: a contribution enters a seal only after the sealer fetched every shard from
its author, checked the sha256 against the announcement and decoded it against the model (shapes, index
ranges, finite tables).

Each announcement is fetched and checked as soon as the sealer sees it (one task per author), so the seal
waits only for the last authors' payloads; a re-announcement (a restarted replica) replaces its check.

Budgets: at most MAX_CONCURRENT_FETCHES authors are fetched at once, each payload capped at the most a
valid payload of its shard can weigh, so the memory of a round's fetches is bounded by the model. Authors
sealed in recent rounds (`trusted`) have slots of their own, so identities that announce first and serve
slowly cannot queue the honest fetches behind theirs. Once sealing starts, checks still running get the
fetch deadline more; one that misses it ends as TimeoutError (its author was late)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

from hetnode.errors import WireError
from hetnode.net.node import SwarmNode
from hetnode.net.streams import PeerRequestError
from hetnode.planning.rounds import Announcement, FetchDeadline
from hetnode.replica.global_model import GlobalModel, sha256_hex
from hetnode.wire.sync_payload import DecodedPayload

MAX_CONCURRENT_FETCHES = 8  # authors whose payloads are in flight to the sealer at once (per class)

Checked = tuple[Announcement, dict[str, bytes], list[DecodedPayload]]  # (claim, payloads, decoded)
# what an announcement's check yields: (payloads, decoded, seconds from announcement to checked)
CheckOutcome = tuple[dict[str, bytes], list[DecodedPayload], float]


class PayloadChecks:
    """The fetch-and-check of each announcement, started when it is first seen (`start`) and consumed
    when the round is sealed (`outcomes`). `own_payload` serves our own announcement without a fetch;
    `trusted()` names the authors with slots of their own."""

    def __init__(
        self,
        node: SwarmNode,
        global_model: GlobalModel,
        own_payload: Callable[[int, str], bytes | None],
        fetch_deadline: FetchDeadline,
        trusted: Callable[[], set[str]],
    ) -> None:
        self.node = node
        self.global_model = global_model
        self.own_payload = own_payload
        self.fetch_deadline = fetch_deadline
        self.trusted = trusted
        self._checks: dict[tuple[int, str], tuple[Announcement, asyncio.Task]] = {}
        self._fetching = {trusted: asyncio.Semaphore(MAX_CONCURRENT_FETCHES) for trusted in (True, False)}

    def checking(self) -> int:
        """Announcements whose payloads are still being fetched and checked."""
        return sum(not task.done() for _, task in self._checks.values())

    def start(self, announcement: Announcement) -> asyncio.Task:
        key = (announcement.round, announcement.peer_id)
        if key in self._checks:
            self._checks.pop(key)[1].cancel()  # an earlier announcement of this peer, dropped since
        task = asyncio.create_task(self._fetch_and_check(announcement), name=f"check-{key}")
        # the seal reads the outcome; a check nobody reads (a round gone by) must not log "never retrieved"
        task.add_done_callback(lambda done: done.cancelled() or done.exception())
        self._checks[key] = (announcement, task)
        return task

    def forget_before(self, round_: int) -> None:
        """Cancel the checks of rounds gone by."""
        for key in [key for key in self._checks if key[0] < round_]:
            self._checks.pop(key)[1].cancel()

    def _check_of(self, announcement: Announcement) -> asyncio.Task:
        """The check started for this very announcement, or a new one; the seal consumes it."""
        key = (announcement.round, announcement.peer_id)
        started = self._checks.get(key)
        if started is None or started[0] != announcement:
            return self.start(announcement)
        task = started[1]
        if task.done() and not task.cancelled() and isinstance(task.exception(), PeerRequestError):
            return self.start(announcement)  # unreachable then, perhaps not now: as if not prefetched
        return task

    async def outcomes(self, order: list[Announcement]) -> list[CheckOutcome | BaseException]:
        """Each announcement's check outcome; a check not done within the fetch deadline is cancelled and
        its outcome is TimeoutError (the author was late)."""
        checks = [self._check_of(a) for a in order]
        # used up: a peer dropped from `seen` is fetched afresh when it is seen again
        for announcement in order:
            self._checks.pop((announcement.round, announcement.peer_id), None)
        if not checks:
            return []
        _, pending = await asyncio.wait(checks, timeout=self.fetch_deadline.seconds)
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
        outcomes: list[CheckOutcome | BaseException] = []
        for task in checks:
            if task in pending or task.cancelled():
                outcomes.append(TimeoutError())
            else:
                outcomes.append(task.exception() or task.result())
        return outcomes

    async def announcement_changed(self, announcement: Announcement) -> bool:
        """Its author announced other payloads for the round since (it restarted): a failed check of the
        old ones is stale, not hostile."""
        entry = (await self.node.read_field("announce")).get(announcement.peer_id)
        value = entry.value if entry is not None else None
        return (
            isinstance(value, dict)
            and value.get("round") == announcement.round
            and dict(value.get("shards", {})) != dict(announcement.shards)
        )

    async def _fetch_and_check(self, announcement: Announcement) -> CheckOutcome:
        if not announcement.shards or not set(announcement.shards) <= set(self.global_model.shards):
            raise WireError("shards", f"announced shards {sorted(announcement.shards)} are not the model's")
        peer, shards = announcement.peer_id, list(announcement.shards)
        if peer == self.node.identity.peer_id:
            found = [self.own_payload(announcement.round, shard) for shard in shards]
        else:
            # the most a valid payload of these shards can weigh: an author cannot make us hold more
            max_bytes = max(self.global_model.sparse_specs[shard].max_payload_bytes() for shard in shards)
            # a stalled author gives its slot back within a deadline (TimeoutError: it was late)
            async with self._fetching[peer in self.trusted()]:
                found = await self.node.fetch_payloads(
                    peer,
                    announcement.round,
                    [(shard, peer) for shard in shards],
                    max_bytes,
                    stall_s=self.fetch_deadline.ceiling_s,
                )
        payloads = {}
        for shard, data in zip(shards, found, strict=True):
            if data is None or sha256_hex(data) != announcement.shards[shard]:
                raise WireError(f"shards.{shard}", "payload differs from its announced sha256")
            payloads[shard] = data
        decoded = await asyncio.to_thread(
            self.global_model.decode_contribution, announcement.peer_id, announcement.round, payloads
        )
        return payloads, decoded, time.monotonic() - announcement.seen_at
