"""Sealing a sync round (DESIGN §3.5), shared by the coordinator and by the anchor that stands in for it.

A contribution enters the seal only after the sealer fetched every shard from its author, checked the
sha256 against the announcement and decoded it against the model (shapes, index ranges, finite tables).
A payload that is invalid is excluded, logged with the peer id, and its author is banned for a while; an
author that cannot be reached (it left mid-round) is excluded too, but only held back for a short retry
interval. Before sealing, the sealer aggregates the round exactly as appliers will (`GlobalModel.prepare`)
and excludes any contribution whose step would not be finite, so nothing it seals can fail later (TRUST
§2). A seal lists only payloads every replica can apply, so nobody drops a contribution on its own,
and it never lists none: a round in which nothing valid arrived stays open. The sealer keeps the validated
payloads and serves them to every replica. Each seal names the previous seal's hash (`prev`): replicas
accept only the next link of the chain they hold.

Budgets: at most MAX_CONCURRENT_FETCHES authors are fetched at once, each payload capped at the most a
valid payload of its shard can weigh, so the memory of a round's fetches is bounded by the model. Authors
sealed in recent rounds have slots of their own, so identities that announce first and serve slowly cannot
queue the honest fetches behind theirs.

Two paths: announcements are read from the DHT, and pulled straight from an author that nudges us
(`pull_announcement`), so nodes with chosen ids next to the run's keys cannot hide them.

Deadlines: the round's clock starts at an expected replica's announcement, never a stranger's (`seal_now`);
once sealing starts, payloads still on their way get `FetchDeadline` more, and an author that misses it is
left out and held back (not fetched, not waited for) for a time that doubles while it keeps missing it.

Each announcement is fetched and checked as soon as the sealer sees it (one stream per author), so the
seal waits only for the last authors' payloads; a re-announcement (a restarted replica) replaces it.
"""

from __future__ import annotations

import asyncio
import bisect
import itertools
import logging
import time
from collections import deque
from collections.abc import Awaitable, Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from hetnode.algo.scoring import steps_shown
from hetnode.config import Config
from hetnode.errors import WireError
from hetnode.net.node import StoredValue, SwarmNode
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
from hetnode.replica.global_model import ApplyError, GlobalModel, PreparedRound, sha256_hex
from hetnode.training.schedule import schedule_position, warmup_cosine
from hetnode.wire.seals import seal_digest
from hetnode.wire.sync_payload import DecodedPayload

log = logging.getLogger(__name__)

BAN_S = 120.0  # an author of an invalid payload is ignored this long
RETRY_S = 5.0  # an unreachable author's announcement is tried again after this long
POLL_RETRY_S = 0.5  # a re-announced contribution is read again after this long
SEAL_TTL_S = 3600.0
MAX_CONCURRENT_FETCHES = 8  # authors whose payloads are in flight to the sealer at once (per class)
TRUSTED_ROUNDS = 8  # an author sealed in this many recent rounds starts the round's clock and has own slots
MAX_DIRECT = 10_000  # announcements pulled from their authors and kept (this round's and the last)
MAX_PULLS = 64  # direct pulls in flight at once


Checked = tuple[Announcement, dict[str, bytes], list[DecodedPayload]]  # (claim, payloads, decoded)
# what an announcement's check yields: (payloads, decoded, seconds from announcement to checked)
CheckOutcome = tuple[dict[str, bytes], list[DecodedPayload], float]
# (round, valid contributions in announcement order) -> {peer: reason} to leave out of the seal (TRUST §4)
# (round, contributions, when each was seen, the inner steps each claims) -> {peer: why it is left out}
Screen = Callable[
    [int, list[tuple[str, list[DecodedPayload]]], dict[str, float], dict[str, int]], dict[str, str]
]
# (round, contributions left out only for their author's record) -> the peers whose work helps on its own
Rescue = Callable[[int, list[tuple[str, list[DecodedPayload]]], dict[str, int]], Awaitable[set[str]]]
# the sealed peers -> the weight each carries in the aggregate (earned by verified history, TRUST §4)
Weigh = Callable[[list[str]], dict[str, int]]
# a claim of steps counts up to this much over what its update's norm shows (honest norms at equal steps
# differ by ±2 %: benchmarks/results/paced_weighting)
STEPS_SLACK = 1.15
RESCUABLE = ("score", "probation")  # screen reasons about an author's record, not about the work itself


def paced_weights(config: Config, earned: dict[str, int], steps: dict[str, int]) -> dict[str, int]:
    """Each sealed contribution's weight in the aggregate: earned by verified history, and under paced
    rounds times its (verified) steps, measured better than 1/N at equal tokens
    (benchmarks/paced_weighting.py; docs/sync.md, "Paced rounds"). At most probation_rounds × the cap."""
    if not config.outer.paced:
        return dict(earned)
    return {peer: w * max(1, steps.get(peer, config.outer.inner_steps)) for peer, w in earned.items()}


def round_lr(config: Config, round_: int) -> list[float]:
    """The learning rate of each inner step a replica may take in paced round `round_`, up to the cap
    (every replica's schedule, `schedule_position`)."""
    o, inner = config.outer, config.inner
    return [
        warmup_cosine(
            schedule_position(round_, i, o.inner_steps, o.step_cap),
            inner.lr,
            inner.warmup_steps,
            config.train.max_steps,
            inner.min_lr_ratio,
        )
        for i in range(o.step_cap)
    ]


def verified_steps(
    config: Config,
    round_: int,
    updates: Mapping[str, Mapping[str, tuple]],
    claimed: Mapping[str, int],
    weights: Mapping[str, int],
) -> dict[str, int]:
    """Paced round `round_`: the steps each update counts, min(claimed, the most whose summed learning rate
    is within STEPS_SLACK × what its norm shows), at least 1 (`steps_shown`; docs/sync.md)."""
    work = list(itertools.accumulate(round_lr(config, round_), initial=0.0))  # work[n]: lr of n steps
    shown = steps_shown(updates, {p: work[claimed[p]] for p in updates}, weights)
    return {
        p: max(1, min(claimed[p], bisect.bisect_right(work, shown[p] * STEPS_SLACK) - 1)) for p in updates
    }


def per_replica(
    good: list[Checked], steps: dict[str, int], earned: dict[str, int], replica_of: Mapping[str, str]
) -> list[tuple[float, int, int]]:
    """(seconds in inner steps, steps, weight) per replica for the round's budget: a chain once, at its
    slowest stage's time, its fewest steps and its lightest stage's weight."""
    by_replica: dict[str, list[tuple[float, int, int]]] = {}
    for a, _, _ in good:
        key = replica_of.get(a.peer_id, a.peer_id)
        by_replica.setdefault(key, []).append((a.train_s, steps[a.peer_id], earned[a.peer_id]))
    return [
        (max(t for t, _, _ in parts), min(n for _, n, _ in parts), min(w for _, _, w in parts))
        for parts in by_replica.values()
    ]


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
        self.own_payload = own_payload
        self.node = node
        self.global_model = global_model
        self.payloads: dict[tuple[int, str, str], bytes] = {}  # (round, replica, shard) -> validated bytes
        self._last_first: float | None = None  # when the previous round's first announcement arrived
        # expected replicas the last seal went without: their late announcements still teach the deadline
        self._late: tuple[int, float, set[str]] = (-1, 0.0, set())
        self.banned: dict[str, float] = {}
        # fetch-and-check of each announcement, started when it is first seen: by the time the round is
        # sealed only the last announcers' payloads are still on their way
        self._checks: dict[tuple[int, str], tuple[Announcement, asyncio.Task]] = {}
        self._fetching = {trusted: asyncio.Semaphore(MAX_CONCURRENT_FETCHES) for trusted in (True, False)}
        self._sealed_recently: deque[frozenset[str]] = deque(maxlen=TRUSTED_ROUNDS)
        self.times_late: dict[str, int] = {}  # author -> rounds running it missed the fetch deadline
        self.direct: dict[str, StoredValue] = {}  # announcements pulled from their authors
        self._pulling: set[str] = set()
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
        call `then`), whatever the DHT does with it. One pull per peer at a time; a banned peer is not
        asked."""
        if (
            peer in self._pulling
            or len(self._pulling) >= MAX_PULLS
            or self.banned.get(peer, 0.0) > time.monotonic()
        ):
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

    async def _announcements(self, round_: int) -> dict[str, StoredValue]:
        """This round's view of every author's announcement: the DHT's, or the one pulled from the author
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

    async def collect(self, round_: int, seen: dict[str, Announcement]) -> None:
        """Add this round's new announcements (first sight time recorded; banned peers ignored)."""
        now = time.monotonic()
        late_round, late_first, late_missing = self._late
        for peer, entry in (await self._announcements(round_)).items():
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
            self._start_check(seen[peer])
        for key in [key for key in self._checks if key[0] < round_]:  # rounds gone by
            self._checks.pop(key)[1].cancel()

    def checking(self) -> int:
        """Announcements whose payloads are still being fetched and checked."""
        return sum(not task.done() for _, task in self._checks.values())

    def _start_check(self, announcement: Announcement) -> asyncio.Task:
        key = (announcement.round, announcement.peer_id)
        if key in self._checks:
            self._checks.pop(key)[1].cancel()  # an earlier announcement of this peer, dropped since
        task = asyncio.create_task(self._fetch_and_check(announcement), name=f"check-{key}")
        # seal() reads the outcome; a check nobody reads (a round gone by) must not log "never retrieved"
        task.add_done_callback(lambda done: done.cancelled() or done.exception())
        self._checks[key] = (announcement, task)
        return task

    def _check_of(self, announcement: Announcement) -> asyncio.Task:
        """The check started for this very announcement, or a new one; the seal consumes it."""
        key = (announcement.round, announcement.peer_id)
        started = self._checks.get(key)
        if started is None or started[0] != announcement:
            return self._start_check(announcement)
        task = started[1]
        if task.done() and not task.cancelled() and isinstance(task.exception(), PeerRequestError):
            return self._start_check(announcement)  # unreachable then, perhaps not now: as if not prefetched
        return task

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
    ) -> SealedRound | None:
        """Validate every announced contribution, aggregate the valid ones, keep their payloads to serve
        and write the seal record; nothing is stored yet (the coordinator first puts on disk what its
        catch-up needs after a crash, then calls `publish`). `replica_of`: peer -> its replica (a chain's
        stages: the chain), so that a paced round's budget counts a chain once (None: each on its own);
        `floors`: the seconds live replicas say their floor of steps takes (`RoundBudget.seconds_for`).

        None when no contribution was valid: nothing is sealed, and the excluded announcements are dropped
        from `seen` so the round stays open for whoever announces next."""
        good: list[Checked] = []
        excluded = []
        order = sealed_order(seen.values())
        checked = await self._checked_in_time(order)
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
                if await self._announcement_changed(announcement):
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
        rejected = self._screened(round_, good)
        if good and len(rejected) == len(good):
            rejected = await self._rescued(round_, good, rejected)
        excluded += sorted(rejected)
        good = [g for g in good if g[0].peer_id not in rejected]
        earned = self._weights([a.peer_id for a, _, _ in good])
        if self.config.outer.paced:  # steps are claims: each counts only the steps its update shows
            # off the loop: judging each update against all the others grows as the cube of their number
            steps |= await asyncio.to_thread(
                self._verified_steps, round_, good, steps, earned, replica_of or {}
            )
        weights = paced_weights(self.config, earned, steps)
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
                    # capped, and under paced rounds no more than its update shows (`_verified_steps`)
                    "steps": steps[a.peer_id],
                }
                for a, _, _ in good
            ],
            "excluded": excluded,
            "sealed_at": time.time(),
            "prev": self.global_model.seal_hash or "",
        }
        if self.budget is not None:
            self.budget.observe(per_replica(good, steps, earned, replica_of or {}))
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

    async def _checked_in_time(self, order: list[Announcement]) -> list[CheckOutcome | BaseException]:
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

    def _screened(self, round_: int, good: list[Checked]) -> dict[str, str]:
        """The screen's verdicts on the valid contributions (they are left out, not banned: the verifier
        keeps scoring them, and a peer whose work helps again comes back)."""
        if self.screen is None or not good:
            return {}
        by_arrival = sorted(good, key=lambda g: (g[0].seen_at, g[0].peer_id))
        try:
            rejected = self.screen(
                round_,
                [(a.peer_id, decoded) for a, _, decoded in by_arrival],
                {a.peer_id: a.seen_at for a, _, _ in by_arrival},
                {a.peer_id: a.steps for a, _, _ in by_arrival},
            )
        except Exception:  # a verifier bug must not stop sealing: seal unscreened and say so
            log.exception("round %d: screening failed; sealing without it", round_)
            return {}
        for peer, reason in sorted(rejected.items()):
            log.warning("round %d: leaving out %s's contribution: %s", round_, peer, reason)
        return rejected

    def _verified_steps(
        self,
        round_: int,
        good: list[Checked],
        claimed: dict[str, int],
        earned: dict[str, int],
        replica_of: Mapping[str, str],
    ) -> dict[str, int]:
        """Paced rounds: each sealed contribution's steps. An anchor's, no more than its update's norm
        shows against the round's other anchors (`verified_steps`): a replica that claims more steps than
        it took gains neither weight nor credit by it. A chain stage's, its chain's fewest: a chain's
        stages train one count of micro-batches, which every later stage counts as they arrive (a stage's
        update, trained in a subspace by another optimiser, is no yardstick for an anchor's, nor the
        reverse)."""
        chain_of = {a.peer_id: replica_of.get(a.peer_id, a.peer_id) for a, _, _ in good}
        anchors = [a for a in good if chain_of[a[0].peer_id] == a[0].peer_id]
        updates = {
            a.peer_id: {n: v for m in decoded for n, v in m.sparse.items()} for a, _, decoded in anchors
        }
        verified = verified_steps(self.config, round_, updates, claimed, earned)
        fewest: dict[str, int] = {}
        for peer, key in chain_of.items():
            if peer not in verified:
                fewest[key] = min(fewest.get(key, claimed[peer]), claimed[peer])
        verified |= {peer: fewest[key] for peer, key in chain_of.items() if peer not in verified}
        for peer in sorted(p for p in verified if verified[p] < claimed[p]):
            log.info("%s claims %d steps, its update shows %d", peer[-8:], claimed[peer], verified[peer])
        return verified

    def _weights(self, peers: list[str]) -> dict[str, int]:
        """Each sealed peer's weight in the aggregate (1 each when a bug leaves none to give)."""
        if self.weigh is None:
            return {peer: self.recent_weights.get(peer, 1) for peer in peers}
        try:
            weights = self.weigh(peers)
            if set(weights) != set(peers):
                raise ValueError(f"weights for {sorted(weights)}, not {sorted(peers)}")
            return weights
        except Exception:  # a verifier bug must not stop sealing: seal with equal weights and say so
            log.exception("weighing the round's contributions failed; sealing them with weight 1")
            return dict.fromkeys(peers, 1)

    async def _rescued(self, round_: int, good: list[Checked], rejected: dict[str, str]) -> dict[str, str]:
        """The screen left nothing: contributions left out only for their author's record (a negative
        average, or none yet) are sealed after all if their update alone lowers the loss, so that a replica
        left alone (a chain whose anchor died, newcomers after everyone else left) keeps the swarm going.
        Their credit still waits for their record (TRUST §4)."""
        candidates = [(a.peer_id, decoded) for a, _, decoded in good if rejected[a.peer_id] in RESCUABLE]
        if self.rescue is None or not candidates:
            return rejected
        try:
            helping = await self.rescue(round_, candidates, {a.peer_id: a.steps for a, _, _ in good})
        except Exception:  # a verifier bug must not seal what the screen refused
            log.exception("round %d: judging the screened-out contributions failed", round_)
            return rejected
        if helping:
            log.info(
                "round %d: every contribution was screened out; sealing %s: their update lowers the loss",
                round_,
                ", ".join(sorted(helping)),
            )
        return {peer: reason for peer, reason in rejected.items() if peer not in helping}

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

    async def _announcement_changed(self, announcement: Announcement) -> bool:
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
