"""Sealing a sync round (docs/sync.md, "Rounds over the network"), shared by the coordinator and by the anchor
that stands in for it: the `Sealer` collects the round's announcements, decides when to seal and what the seal
holds.

Every announced contribution is fetched and checked as soon as it is seen (`payload_checks.py`). A payload
that is invalid is excluded, logged with the peer id, and its author is banned for a while; an author that
cannot be reached (it left mid-round) is excluded too, but only held back for a short retry interval. The
coordinator's verifier screens and weighs what is valid (`seal_screening.py`, `seal_weights.py`). Before
sealing, the sealer aggregates the round exactly as appliers will (`GlobalModel.prepare`) and excludes any
contribution whose step would not be finite, so nothing it seals can fail later (docs/security.md, "Crash the
coordinator or a replica with one payload"). A seal lists only payloads every replica can apply, so nobody
drops a contribution on its own, and it never lists none: a round in which nothing valid arrived stays open.
The sealer keeps the validated payloads and serves them to every replica. Each seal names the previous seal's
hash (`prev`): replicas accept only the next link of the chain they hold.

Two paths: announcements are read from the DHT, and pulled straight from an author that nudges us
(`pull_announcement`), so nodes with chosen ids next to the run's keys cannot hide them.

Deadlines: the round's clock starts at an expected replica's announcement, never a stranger's (`seal_now`);
once sealing starts, payloads still on their way get `FetchDeadline` more, and an author that misses it is
left out and held back (not fetched, not waited for) for a time that doubles while it keeps missing it.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from hetnode.config import Config
from hetnode.errors import WireError
from hetnode.net.node import SwarmNode
from hetnode.net.streams import PeerRequestError
from hetnode.planning.rounds import (
    Announcement,
    ArrivalDeadline,
    FetchDeadline,
    RoundBudget,
    held_back_s,
    paced_deadline,
    seal_now,
    sealed_order,
)
from hetnode.protocol.announcement_reads import AnnouncementReader
from hetnode.protocol.payload_checks import Checked, PayloadChecks
from hetnode.protocol.seal_screening import Rescue, Screen, Weigh, earned_weights, rescued, screened
from hetnode.protocol.seal_weights import (
    paced_weights,
    per_replica,
    pool_workers,
    sealed_steps,
    verified_steps,  # noqa: F401  (trust_bench imports it from here)
)
from hetnode.replica.global_model import ApplyError, GlobalModel, PreparedRound
from hetnode.wire.seals import seal_digest
from hetnode.wire.sync_payload import DecodedPayload

log = logging.getLogger(__name__)

BAN_S = 120.0  # an author of an invalid payload is ignored this long
RETRY_S = 5.0  # an unreachable author's announcement is tried again after this long
POLL_RETRY_S = 0.5  # a re-announced contribution is read again after this long
SEAL_TTL_S = 3600.0
TRUSTED_ROUNDS = 8  # an author sealed in this many recent rounds starts the round's clock and has own slots


@dataclass(frozen=True)
class SealedRound:
    record: dict[str, Any]  # what went into the DHT
    contributions: list[tuple[str, dict[str, bytes]]]  # (peer, shard -> payload), in sealed order
    excluded: list[str]
    prepared: PreparedRound  # the checked aggregate: committing it is the coordinator's apply
    rejected: dict[str, str]  # valid contributions the screen left out: peer -> reason
    valid: list[tuple[str, list[DecodedPayload]]]  # every valid contribution, sealed or screened out
    steps: dict[str, int] = field(default_factory=dict)  # the inner steps each valid one claims, capped
    earned: dict[str, int] = field(default_factory=dict)  # each sealed one's weight by verified history

    @property
    def digest(self) -> str:
        return seal_digest(self.record)


class Sealer:
    def __init__(
        self,
        config: Config,
        node: SwarmNode,
        global_model: GlobalModel,
        own_payload: Callable[[int, str], bytes | None] = lambda round_, shard: None,
    ) -> None:
        self.config = config
        self.node = node
        self.global_model = global_model
        self.payloads: dict[tuple[int, str, str], bytes] = {}  # (round, replica, shard) -> validated bytes
        self._last_first: float | None = None  # when the previous round's first announcement arrived
        # expected replicas the last seal went without: their late announcements still teach the deadline
        self._late: tuple[int, float, set[str]] = (-1, 0.0, set())
        self.banned: dict[str, float] = {}
        self._sealed_recently: deque[frozenset[str]] = deque(maxlen=TRUSTED_ROUNDS)
        self.times_late: dict[str, int] = {}  # author -> rounds running it missed the fetch deadline
        self.announcements = AnnouncementReader(node)
        self.missed: set[str] = set()  # expected by an earlier seal, not announced since
        self.screen: Screen | None = None  # the coordinator's verifier; a stand-in seals unscreened
        self.rescue: Rescue | None = None  # asked when the screen leaves nothing to seal
        # the coordinator's verifier weighs; a stand-in keeps the weights of the last seal it applied
        # (an identity absent from it weighs 1: a newcomer while the coordinator is away)
        self.weigh: Weigh | None = None
        self.recent_weights: dict[str, int] = {}
        n = config.network
        self.deadline = ArrivalDeadline(
            floor_s=max(1.0, n.heartbeat_s), ceiling_s=max(30.0, 10 * n.boundary_s)
        )
        o = config.outer
        self.budget = (
            RoundBudget(
                o.inner_steps, o.min_round_s, o.max_round_s, o.step_cap / o.inner_steps, o.budget_quantile
            )
            if o.paced
            else None
        )
        self.budget_s: float | None = None  # paced: the budget the last seal gave the round now open
        author_bytes = sum(spec.max_payload_bytes() for spec in global_model.sparse_specs.values())
        self.fetch_deadline = FetchDeadline(
            floor_s=FetchDeadline.floor_for(author_bytes, n.stage_min_up_mbps, max(1.0, n.heartbeat_s)),
            ceiling_s=self.deadline.ceiling_s,
        )
        # fetch-and-check of each announcement, started when it is first seen: by the time the round is
        # sealed only the last announcers' payloads are still on their way
        self.checks = PayloadChecks(node, global_model, own_payload, self.fetch_deadline, self.trusted)

    def trusted(self) -> set[str]:
        """Authors sealed in recent rounds: they start a round's clock and have fetch slots of their own."""
        return set().union(*self._sealed_recently)

    def ready(self, expected: set[str], seen: dict[str, Announcement]) -> bool:
        """Time to seal: every expected replica announced, or the deadline passed since the first trusted
        expected one did (a stranger's early announcement does not start the clock)."""
        return seal_now(
            expected,
            seen,
            time.monotonic(),
            paced_deadline(self.deadline.seconds, self.deadline.floor_s, self.budget_s),
            ceiling_s=self.deadline.ceiling_s,
            trusted=self.trusted(),
        )

    def serve(self, round_: int, shard: str, replica: str, asker: str = "") -> bytes | None:
        """A payload of a round we sealed (held from the moment of sealing: never an unsealed one)."""
        return self.payloads.get((round_, replica, shard))

    def pull_announcement(self, peer: str, then: Callable[[], None] = lambda: None) -> None:
        """`peer` nudged us about its announcement: take it straight from it too (in the background, then
        call `then`), whatever the DHT does with it. A banned peer is not asked."""
        if self.banned.get(peer, 0.0) <= time.monotonic():
            self.announcements.pull(peer, then)

    async def collect(self, round_: int, seen: dict[str, Announcement]) -> None:
        """Add this round's new announcements (first sight time recorded; banned peers ignored)."""
        now = time.monotonic()
        late_round, late_first, late_missing = self._late
        for peer, entry in (await self.announcements.read(round_)).items():
            value = entry.value
            if self.banned.get(peer, 0.0) > now:
                continue  # neither in the round nor a lesson for the deadline
            if value.get("round") == late_round and peer in late_missing:
                late_missing.discard(peer)  # it came, too late: wait this long next time
                self.deadline.observe(now - late_first)
            if value.get("round") in (round_ - 1, round_):
                self.missed.discard(peer)  # delivering again (if late): wait for it from the next seal on
            if value.get("round") != round_:
                continue
            if peer in seen:
                if dict(value["shards"]) == dict(seen[peer].shards):
                    continue
                # it restarted and trained the round again: the new payload replaces the old one
                log.info("round %d: peer %s re-announced; checking its new payload", round_, peer)
            seen[peer] = Announcement(
                peer,
                round_,
                dict(value["shards"]),
                value["tokens"],
                now,
                value.get("steps", 0),
                value.get("train_s") or 0.0,
            )
            self.checks.start(seen[peer])
        self.checks.forget_before(round_)

    def waiting_for(self, expected: set[str]) -> set[str]:
        """The expected replicas a seal still waits for: banned ones are not, and neither is a replica that
        missed a round it was waited for, until it announces again (a self-declared anchor that never
        delivers must not stretch every round to the deadline)."""
        now = time.monotonic()
        return {peer for peer in expected if self.banned.get(peer, 0.0) <= now and peer not in self.missed}

    def note_missing(self, expected: set[str], seen: dict[str, Announcement]) -> None:
        """After a seal: the expected replicas that did not announce are not waited for any more."""
        self.missed = (self.missed | set(expected)) - set(seen)
        if len(self.missed) > 100_000:  # forget old identities rather than grow without bound
            self.missed.clear()

    def observe_arrivals(self, expected: set[str], seen: dict[str, Announcement]) -> None:
        self.note_missing(expected, seen)
        # measured from the expected replicas' first announcement, as the clock runs: a stranger that
        # announces early must not teach the deadline a wide spread
        arrived = [a.seen_at for p, a in seen.items() if p in expected]
        first = min(arrived or [a.seen_at for a in seen.values()])
        round_ = next(iter(seen.values())).round
        self._late = (round_, first, set(expected) - set(seen))
        if arrived:
            self.deadline.observe(max(arrived) - first)
        if self._last_first is not None:
            self.deadline.observe_round(first - self._last_first)
        self._last_first = first

    async def seal(self, round_: int, seen: dict[str, Announcement]) -> SealedRound | None:
        """Decide the round (`decide`) and store its seal at once (`publish`): the stand-in's way."""
        sealed = await self.decide(round_, seen)
        if sealed is not None:
            await self.publish(sealed, seen)
        return sealed

    async def decide(
        self,
        round_: int,
        seen: dict[str, Announcement],
        replica_of: Mapping[str, str] | None = None,
        floors: Iterable[float] = (),
        stage_of: Mapping[str, int | None] | None = None,
    ) -> SealedRound | None:
        """Validate every announced contribution, aggregate the valid ones, keep their payloads to serve
        and write the seal record; nothing is stored yet (the coordinator first puts on disk what its
        catch-up needs after a crash, then calls `publish`). `replica_of`: peer -> its replica (a chain's
        stages: the chain), so that a paced round's budget counts a chain once (None: each on its own);
        `floors`: the seconds live replicas say their floor of steps takes (`RoundBudget.seconds_for`);
        `stage_of`: a chain member's stage, so that a stage's pool of workers counts as one stage in
        steps and weight (`pool_workers`; None: one worker a stage).

        None when no contribution was valid: nothing is sealed, and the excluded announcements are dropped
        from `seen` so the round stays open for whoever announces next."""
        good: list[Checked] = []
        excluded = []
        order = sealed_order(seen.values())
        checked = await self.checks.outcomes(order)
        for announcement, outcome in zip(order, checked, strict=True):
            peer = announcement.peer_id
            try:
                if isinstance(outcome, BaseException):
                    raise outcome
                payloads, decoded, took = outcome
            except TimeoutError:
                excluded.append(peer)
                self._hold_back_late(round_, peer)
                continue
            except PeerRequestError as exc:
                log.warning("round %d: leaving out unreachable peer %s: %s", round_, peer, exc)
                excluded.append(peer)
                self.banned[peer] = time.monotonic() + RETRY_S
                continue
            except WireError as exc:
                excluded.append(peer)
                if await self.checks.announcement_changed(announcement):
                    # It restarted and re-announced while we fetched: stale, not hostile.
                    log.info("round %d: peer %s re-announced; trying its new payload", round_, peer)
                    self.banned[peer] = time.monotonic() + POLL_RETRY_S
                    continue
                log.warning("round %d: excluding peer %s: %s", round_, peer, exc)
                self.banned[peer] = time.monotonic() + BAN_S
                continue
            self.times_late.pop(peer, None)
            self.fetch_deadline.observe(took)
            good.append((announcement, payloads, decoded))
        valid = [(a.peer_id, decoded) for a, _, decoded in good]
        cap = self.config.outer.step_cap
        steps = {a.peer_id: min(max(a.steps, 0), cap) for a, _, _ in good}
        rejected = screened(self.screen, round_, good)
        if good and len(rejected) == len(good):
            rejected = await rescued(self.rescue, round_, good, rejected)
        excluded += sorted(rejected)
        good = [g for g in good if g[0].peer_id not in rejected]
        earned = earned_weights(self.weigh, self.recent_weights, [a.peer_id for a, _, _ in good])
        replica_of, stage_of = replica_of or {}, stage_of or {}
        if self.config.outer.paced:  # steps are claims: each counts only the steps its update shows
            # off the loop: judging each update against all the others grows as the cube of their number
            steps |= await asyncio.to_thread(
                sealed_steps, self.config, round_, good, steps, earned, replica_of, stage_of
            )
        pooled = pool_workers([a.peer_id for a, _, _ in good], replica_of, stage_of)
        weights = paced_weights(self.config, earned, steps, pooled)
        good, prepared = await self._prepare(round_, good, excluded, weights)
        if prepared is None:
            for peer in excluded:
                del seen[peer]
            log.info("round %d: no valid contribution among %d announced; not sealing", round_, len(excluded))
            return None
        for announcement, payloads, _ in good:
            for shard, data in payloads.items():
                self.payloads[(round_, announcement.peer_id, shard)] = data
        self._sealed_recently.append(frozenset(a.peer_id for a, _, _ in good))
        self.payloads = {k: v for k, v in self.payloads.items() if k[0] >= round_ - 1}
        record = {
            "round": round_,
            "contributions": [
                {
                    "peer": a.peer_id,
                    "shards": dict(a.shards),
                    "tokens": a.tokens,
                    "weight": weights[a.peer_id],
                    # capped, and under paced rounds no more than its update shows (`sealed_steps`)
                    "steps": steps[a.peer_id],
                }
                for a, _, _ in good
            ],
            "excluded": excluded,
            "sealed_at": time.time(),
            "prev": self.global_model.seal_hash or "",
        }
        if self.budget is not None:
            self.budget.observe(per_replica(good, steps, earned, replica_of, stage_of))
            if (budget := self.budget.seconds_for(floors)) is not None:
                record["budget_s"] = float(round(budget, 3))
            self.budget_s = record.get("budget_s")
        contributions = [(a.peer_id, p) for a, p, _ in good]
        return SealedRound(record, contributions, excluded, prepared, rejected, valid, steps, earned)

    async def publish(self, sealed: SealedRound, seen: dict[str, Announcement]) -> None:
        """Store the seal and nudge its announcers (they look now instead of at their next poll)."""
        round_ = sealed.record["round"]
        if not await self.node.store_own("seal", sealed.record, ttl_s=SEAL_TTL_S):
            log.warning("round %d: no DHT node accepted the seal yet", round_)
        self.node.nudge(sorted(seen), "seal", round_)

    def _hold_back_late(self, round_: int, peer: str) -> None:
        times = self.times_late.get(peer, 0) + 1
        self.times_late[peer] = times
        hold = held_back_s(times, RETRY_S, BAN_S)
        self.banned[peer] = time.monotonic() + hold
        log.warning(
            "round %d: leaving out %s: its payload was not fetched and checked within the %.1f s deadline "
            "(late %d round(s) running: held back %.0f s)",
            round_,
            peer,
            self.fetch_deadline.seconds,
            times,
            hold,
        )
        if len(self.times_late) > 100_000:  # forget old identities rather than grow without bound
            self.times_late.clear()

    async def _prepare(
        self, round_: int, good: list[Checked], excluded: list[str], weights: dict[str, int]
    ) -> tuple[list[Checked], PreparedRound | None]:
        """Aggregate the valid contributions as appliers will (with their `weights`); a contribution whose
        step alone would not be finite is excluded (and its author banned). None when nothing is left."""
        prepare = self.global_model.prepare
        while good:
            try:
                contributions = [(a.peer_id, decoded) for a, _, decoded in good]
                return good, await asyncio.to_thread(prepare, round_, contributions, weights)
            except ApplyError as exc:
                culprits = set()
                for announcement, _, decoded in good:
                    alone = [(announcement.peer_id, decoded)]
                    try:
                        await asyncio.to_thread(prepare, round_, alone, weights)
                    except ApplyError:
                        culprits.add(announcement.peer_id)
                culprits = culprits or {a.peer_id for a, _, _ in good}  # only together: θ is at fault
                log.warning("round %d: excluding %s: %s", round_, sorted(p[-8:] for p in culprits), exc)
                for peer in sorted(culprits):
                    excluded.append(peer)
                    self.banned[peer] = time.monotonic() + BAN_S
                good = [g for g in good if g[0].peer_id not in culprits]
        return good, None
