"""A replica's part in sealed rounds, shared by anchors and chain stages (docs/sync.md and docs/swarm.md).

`RoundParticipant` signs and announces a payload, waits for the seal (`seal_wait`), fetches exactly the
sealed payloads from any holder (their authors, replicas that applied the round, the sealer last:
`payload_fetch`), checks their sha256 against the seal and their authors' signatures, and applies all of
them or none. It then serves what it applied for KEEP_ROUNDS rounds, so a round's payloads spread without
a hub.

Who may seal (docs/security.md, "Who is trusted with what"): the coordinator, or, while its record has
expired, the lowest-id live stand-in the signed manifest lists (none unless the operator named some). A seal
counts only as the next link of the chain this replica holds (`seal_verdict`): a far-future seal, a fork or a
seal by anyone else is ignored. When a round cannot be applied here it catches up by downloading θ from the
sealer (`protocol/state_fetch.py`), checked against the digests the sealer signs: the coordinator's `head`
entry, a stand-in's peer record. After every round the replica compares its own digests with the coordinator's
head.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import logging
import time
from pathlib import Path

from hetnode.config import Config
from hetnode.daemon.held_payloads import KEEP_ROUNDS, HeldPayloads
from hetnode.daemon.payload_fetch import PayloadsUnavailable, fetch_sealed
from hetnode.daemon.seal_wait import SealWaiter, read_head, read_seal
from hetnode.errors import HetnodeError, WireError
from hetnode.net.node import SwarmNode
from hetnode.net.records import MAX_ROUND_S
from hetnode.net.signing import sign_payload
from hetnode.net.streams import PeerRequestError
from hetnode.planning.fetch import DEMOTED_ROUNDS, Holder, fetch_order, holders_of
from hetnode.protocol.sealing import Sealer
from hetnode.protocol.state_fetch import fetch_state
from hetnode.protocol.swarm_view import SwarmView
from hetnode.protocol.view import PeerDirectory
from hetnode.replica.global_model import ApplyError, GlobalModel, sha256_hex
from hetnode.service.lifecycle import sleep_or_stop
from hetnode.service.metrics import PeerMetrics
from hetnode.service.round_log import UTILIZATION_ROUNDS, RoundRecord, append_round, rolling_utilization
from hetnode.wire.seals import seal_digest

log = logging.getLogger(__name__)

PREFERRED_SEALS = 4  # authors of this many recent seals may take the stream slots kept for replicas


@dataclasses.dataclass(frozen=True)
class Outcome:
    """How a round we announced ended here. `applied`: we applied its seal (else θ was downloaded);
    `included`: our payload is in θ (False: it goes back into error feedback; None: unknown, dropped)."""

    applied: bool
    included: bool | None

    @property
    def left_out(self) -> bool:
        return self.included is False


class RoundFailed(HetnodeError):
    """A sealed round could not be applied here (payload unavailable or invalid): catch up from state."""


class RoundParticipant:
    """One replica's side of the round protocol. `keep(round, payloads)` holds what it is about to announce,
    served to the round's sealers, and to every replica once the round is sealed (`held_payloads`)."""

    def __init__(
        self,
        config: Config,
        node: SwarmNode,
        coordinator: str,
        global_model: GlobalModel,
        may_stand_in: bool,
        data_dir: Path,
        metrics: PeerMetrics | None = None,
        stand_ins: tuple[str, ...] = (),
        directory: PeerDirectory | None = None,
    ) -> None:
        """`stand_ins`: the manifest's list of peers that may seal while the coordinator is silent;
        `may_stand_in`: this replica's role allows it (anchors only: a stage never seals);
        `directory`: the daemon's shared reads of the peer records (one of our own if not given)."""
        self.config = config
        self.node = node
        self.coordinator = coordinator
        self.global_model = global_model
        self.last_sources: dict[str, int] = {}  # peer -> bytes it served us in the last apply
        self.failed_us: dict[str, int] = {}  # holder -> the last round it failed to serve us
        self.stand_ins = tuple(sorted(set(stand_ins) - {coordinator}))
        self.may_stand_in = may_stand_in and node.identity.peer_id in self.stand_ins
        self.data_dir = data_dir  # gets the round log
        self.metrics = metrics
        self.peer_id = node.identity.peer_id
        self.sealer = Sealer(config, node, global_model, self.own_payload)
        self.held = HeldPayloads(
            self.peer_id,
            {coordinator, *self.stand_ins},
            self.sealer.serve,
            self._wake_seal_wait,
            lambda: global_model.params_round,
        )
        n = config.network
        self.view = directory or PeerDirectory(node, config, n.heartbeat_s, n.heartbeat_s)
        self.last_seal_wait_s = 0.0  # of the last wait_for_seal
        self.last_apply = (0.0, 0, 0.0)  # (seconds, bytes fetched, seconds fetching) of the last apply
        self.last_contributors = 1  # in the last seal we applied
        self.round_budget_s: float | None = None  # paced rounds: the newest budget a seal gave us
        self.seal_seen: tuple[int, float] | None = None  # the newest seal we saw: (round, monotonic time)
        # authors of the last seals we applied: they fetch this round's payloads from us, so stream slots
        # are kept for them (and the sealers) that a crowd of strangers cannot fill
        self._recent_authors: collections.deque[frozenset[str]] = collections.deque(maxlen=PREFERRED_SEALS)
        node.prefer(self.stand_ins)
        self.recent_rounds: collections.deque[RoundRecord] = collections.deque(maxlen=UTILIZATION_ROUNDS)
        node.set_payloads(self.held.serve)
        node.set_state(self.serve_state)
        self.unchecked: int | None = None  # the round applied last, until compared with the coordinator's
        self.seals = SealWaiter(
            config,
            node,
            coordinator,
            global_model,
            self.sealer,
            self.view,
            self.acting_stand_in,
            self.may_stand_in,
        )
        node.set_nudge_handler(self._on_nudge)

    @property
    def utilization(self) -> float | None:
        """Our compute utilisation over the last rounds we synced (advice for people, in our record)."""
        return rolling_utilization(self.recent_rounds)

    def _on_nudge(self, peer: str, topic: str, round_: int) -> None:
        if topic == "seal":
            self.seals.nudged()

    def keep(self, round_: int, messages: dict[str, bytes]) -> dict[str, bytes]:
        """Sign our payload messages of `round_` and hold them (and the round before's, which a late sealer
        may still fetch); returns the signed payloads, whose sha256 we announce."""
        run = self.node.run or ""
        signed = {shard: sign_payload(self.node.identity, run, body) for shard, body in messages.items()}
        self.held.keep_own(round_, signed)
        return signed

    def own_payload(self, round_: int, shard: str) -> bytes | None:
        return self.held.own_payload(round_, shard)

    def _wake_seal_wait(self) -> None:
        self.seals.nudged()

    def serve_state(self, round_: int, shard: str) -> bytes | None:
        """θ as we hold it, for a peer (the coordinator after a restart) catching up to `round_`."""
        if round_ != self.global_model.params_round or shard not in self.global_model.shards:
            return None
        return self.global_model.state_payload(shard)

    async def take_part(self, announcement: dict, stop: asyncio.Event, record: RoundRecord) -> Outcome | None:
        """Announce, wait for the seal, apply it, and log the round (`record` completed with the sync).

        The outcome says whether the seal was applied here (else θ was downloaded) and what became of our
        payload; the caller settles its error feedback by it. None: stopped."""
        round_ = announcement["round"]
        if await self.verify_agreement(stop) and self.global_model.params_round >= round_:
            # θ came with the seal of our round
            return Outcome(False, await self.settle_unsent(round_, None))
        sealed = await self.wait_for_seal(round_, announcement, stop)
        if sealed is None:
            return None
        included = await self._apply_or_catch_up(round_, sealed, stop)
        if included is None:
            return Outcome(False, await self.settle_unsent(round_, sealed[1]))
        if not included:
            # Left out of the seal: what we sent never reached θ, so it goes back into error feedback.
            log.info("round %d sealed without us: our payload is kept in error feedback", round_)
        apply_s, fetched, fetch_s = self.last_apply
        synced = dataclasses.replace(
            record,
            download_bytes=fetched,
            seal_wait_s=round(self.last_seal_wait_s, 3),
            apply_s=round(apply_s, 3),
            fetch_s=round(fetch_s, 3),
            included=included,
        )
        append_round(self.data_dir, synced)
        self.recent_rounds.append(synced)
        if self.metrics is not None:
            self.metrics.add_round(synced)
        await self.verify_agreement(stop)  # else at the start of the next round
        return Outcome(True, included)

    def _take_budget(self, seal: dict) -> None:
        """Paced rounds: the budget a seal sets for the rounds to come (a seal without one, a stand-in's,
        leaves the last one standing). Taken from every seal we move to, applied or caught up to: a
        replica too slow to be sealed must still learn the budget that would fit it in."""
        budget = seal.get("budget_s")
        if isinstance(budget, float) and 0 < budget <= MAX_ROUND_S:
            self.round_budget_s = budget

    def _saw_seal(self, round_: int) -> None:
        if self.seal_seen is None or round_ > self.seal_seen[0]:
            self.seal_seen = (round_, time.monotonic())

    async def sit_out(self, round_: int, stop: asyncio.Event) -> bool:
        """Take no part in `round_` (paced: this replica is too slow for the budget): wait for its seal and
        apply it, or catch up. False: stopped."""
        sealed = await self.wait_for_seal(round_, None, stop)
        if sealed is None:
            return False
        await self._apply_or_catch_up(round_, sealed, stop)
        return not stop.is_set()

    async def _apply_or_catch_up(
        self, round_: int, sealed: tuple[str, dict], stop: asyncio.Event
    ) -> bool | None:
        """Apply the seal that came for `round_`; when it cannot be applied here, catch up from the sealer.
        Whether our contribution is in it; None: caught up instead."""
        try:
            return await self.apply(*sealed)
        except RoundFailed as exc:
            log.warning("round %d: %s; catching up from the sealer", round_, exc)
            await self.catch_up(stop)
            return None

    async def wait_for_seal(
        self, round_: int, announcement: dict | None, stop: asyncio.Event
    ) -> tuple[str, dict] | None:
        """(sealer, seal) for `round_` or later, announcing until then (None: nothing to announce); None
        when stopped.

        The coordinator seals; when it is silent (its record has expired) the lowest-id live stand-in of the
        manifest seals in its place, and every replica accepts that seal too. Seals from anyone else, and
        seals that are not the next link after the one we hold, are not taken (`seal_verdict`)."""
        waiting_since = time.monotonic()
        try:
            sealed = await self.seals.wait(round_, announcement, stop, waiting_since)
            if sealed is not None:
                self.held.saw_seal(sealed[1]["round"])  # our payload of that round may go to anyone now
                self._saw_seal(sealed[1]["round"])
            return sealed
        finally:
            self.last_seal_wait_s = time.monotonic() - waiting_since

    async def apply(self, sealer: str, seal: dict) -> bool:
        """Apply a sealed round to θ; True when our own contribution is in it. RoundFailed otherwise."""
        round_ = seal["round"]
        if round_ != self.global_model.params_round + 1:
            raise RoundFailed(
                f"the seal is for round {round_}, we hold round {self.global_model.params_round}"
            )
        held_hash = self.global_model.seal_hash
        if held_hash is not None and seal.get("prev") != held_hash:
            raise RoundFailed(f"the seal of round {round_} does not follow the seal we hold (a fork)")
        max_bytes = int(self.config.network.max_frame_mb * 2**20)
        started = time.monotonic()
        held_shards = self.global_model.shards  # a chain stage holds, fetches and applies only its layers
        wanted = [
            (c["peer"], shard, digest)
            for c in seal["contributions"]
            for shard, digest in c["shards"].items()
            if shard in held_shards
        ]
        # our own payloads, or all of a round we sealed, are here; the rest come from any holder
        held = {
            (peer, shard): data
            for peer, shard, _ in wanted
            if (peer == self.peer_id or sealer == self.peer_id)
            and (data := self.held.local(round_, shard, peer)) is not None
        }
        remote = [(peer, shard) for peer, shard, _ in wanted if (peer, shard) not in held]
        fetched, fetch_s = 0, 0.0
        if remote:
            peers = (await self.view.get()).peers
            holders = holders_of(
                round_,
                (
                    Holder(peer, r.get("params_round"), frozenset(r.get("layer_digests") or ()))
                    for peer, r in peers.items()
                ),
                KEEP_ROUNDS,
                sealed_authors={c["peer"] for c in seal["contributions"]},
            )
            self.failed_us = {p: r for p, r in self.failed_us.items() if r > round_ - DEMOTED_ROUNDS}
            order = fetch_order(self.peer_id, remote, holders, sealer, demoted=set(self.failed_us))
            digests = {(peer, shard): digest for peer, shard, digest in wanted}
            try:
                result = await fetch_sealed(self.node, round_, order, digests, max_bytes)
            except PayloadsUnavailable as exc:
                raise RoundFailed(str(exc)) from None
            self.failed_us.update(dict.fromkeys(result.passed_over, round_))
            fetched, fetch_s = sum(result.bytes_from.values()), time.monotonic() - started
            self.last_sources = dict(result.bytes_from)
            held.update(result.payloads)
        by_peer: dict[str, dict[str, bytes]] = {}
        for peer, shard, digest in wanted:
            data = held[(peer, shard)]
            if sha256_hex(data) != digest:
                raise RoundFailed(f"{peer[-8:]}'s shard {shard} does not match the sealed digest")
            by_peer.setdefault(peer, {})[shard] = data
        contributions = list(by_peer.items())
        # each contribution's weight, earned by its author's verified history (a seal of an older sealer
        # has none: 1 each)
        weights = {c["peer"]: c.get("weight") or 1 for c in seal["contributions"]}
        try:
            await asyncio.to_thread(self.global_model.apply, round_, contributions, weights)
        except (WireError, ApplyError) as exc:  # θ is untouched: apply is all or nothing
            raise RoundFailed(f"a sealed payload cannot be applied: {exc}") from None
        self.held.keep_applied(round_, held)  # what we applied we serve to others fetching the round
        # what we seal with, should we stand in for the coordinator: the weight earned by history (paced
        # seals' weights also count each contribution's steps)
        steps = {c["peer"]: c.get("steps") or 1 for c in seal["contributions"]}
        paced = self.config.outer.paced
        self.sealer.recent_weights = {p: max(1, w // steps[p]) if paced else w for p, w in weights.items()}
        self._take_budget(seal)
        self.global_model.seal_hash = seal_digest(seal)
        self.last_apply = (time.monotonic() - started, fetched, fetch_s)
        # our weight in a shard's aggregate is about 1 / its senders (a chain's stages each send a part)
        senders = collections.Counter(shard for _, shard, _ in wanted)
        self.last_contributors = max(senders.values(), default=1)
        self._recent_authors.append(frozenset(c["peer"] for c in seal["contributions"]))
        self.node.prefer(set(self.stand_ins).union(*self._recent_authors))
        self.unchecked = round_
        log.info("round %d applied: %d contributions, %d bytes fetched", round_, len(contributions), fetched)
        return any(c["peer"] == self.peer_id for c in seal["contributions"])

    async def settle_unsent(self, round_: int, seal: dict | None) -> bool | None:
        """Whether our payload of `round_` reached θ, when θ was downloaded instead of applied: the seal of
        `round_` says so, or, when we never saw that seal, the coordinator. False: it goes back into error
        feedback; True: the downloaded θ carries it; None (unknown): dropped, never applied twice."""
        if seal is not None and seal.get("round") == round_:
            included: bool | None = any(c["peer"] == self.peer_id for c in seal["contributions"])
        else:
            try:
                included = await self.node.ask_included(self.coordinator, round_)
            except PeerRequestError as exc:
                log.info("round %d: cannot ask the coordinator about our payload: %s", round_, exc)
                included = None
        if included is False:
            log.info("round %d was sealed without us: our payload is kept in error feedback", round_)
        elif included:
            log.info("round %d was sealed with our payload: the downloaded θ carries it", round_)
        else:
            log.warning("round %d: whether the seal took our payload is unknown; it is dropped", round_)
        return included

    async def verify_agreement(self, stop: asyncio.Event) -> bool:
        """Compare our layer digests after the round we last applied with the coordinator's for that round
        (agreement is checked, not only published). A mismatch is counted and logged, and θ is downloaded
        from the coordinator. True when θ was replaced.

        The coordinator publishes its digests right after sealing; until its record shows our round the
        check waits for the next call, and a record already past it leaves the check to the next round."""
        round_ = self.unchecked
        if round_ is None or round_ != self.global_model.params_round:
            self.unchecked = None
            return False
        their_round, theirs = await self.coordinator_theta()
        if not isinstance(their_round, int) or their_round < round_:
            return False
        self.unchecked = None
        if their_round > round_ or not theirs:
            return False
        ours = await asyncio.to_thread(self.global_model.digests)
        differ = sorted(shard for shard, digest in ours.items() if theirs.get(shard) != digest)
        if not differ:
            return False
        log.warning(
            "round %d: layer digests differ from the coordinator's in %s; downloading θ", round_, differ
        )
        if self.metrics is not None:
            self.metrics.digest_mismatches.inc()
        return await self.catch_up(stop, force=True)

    async def coordinator_theta(self) -> tuple[int | None, dict[str, str] | None]:
        """The round the coordinator's θ is at and its digests: from its `head` entry, one small read;
        from its peer record (a read of every record) only when the head is missing."""
        head = await read_head(self.node, self.coordinator)
        if head is not None:
            return head
        record = (await self.view.get(max_age_s=0)).peers.get(self.coordinator, {})
        return record.get("params_round"), record.get("layer_digests")

    def acting_stand_in(self, view: SwarmView) -> str | None:
        """The listed stand-in that seals now: the lowest-id live one, while the coordinator is silent."""
        if self.coordinator in view.peers:
            return None
        live = [peer for peer in self.stand_ins if view.peers.get(peer, {}).get("role") == "anchor"]
        return live[0] if live else None

    async def catch_up(self, stop: asyncio.Event, force: bool = False) -> bool:
        """If the sealer (the coordinator, or the acting stand-in) has sealed rounds we do not hold, or a
        chain we do not hold, download θ from it, checked against the digests its signed record publishes.
        `force`: download even when we hold its round (our θ is known to differ).

        True when θ was replaced (local training state built on the old θ is then stale)."""
        while not stop.is_set():
            view = await self.view.get(max_age_s=0)
            sealer = self.coordinator
            seal = await read_seal(self.node, sealer)
            stand_in = self.acting_stand_in(view)
            if stand_in is not None:
                theirs = await read_seal(self.node, stand_in)
                if theirs is not None and theirs.get("round", -1) > (seal or {}).get("round", -1):
                    sealer, seal = stand_in, theirs
            held = self.global_model.params_round
            if seal is None or seal["round"] < held:
                return False  # nothing sealed yet, or we hold newer θ (a coordinator restarting)
            if seal["round"] == held and seal_digest(seal) == self.global_model.seal_hash and not force:
                return False  # we hold exactly that round
            if sealer == self.coordinator:
                their_round, digests = await self.coordinator_theta()
            else:
                record = view.peers.get(sealer, {})
                their_round, digests = record.get("params_round"), record.get("layer_digests")
            digests = digests if their_round == seal["round"] else None
            if sealer != self.coordinator and digests is None:
                log.info(
                    "catch-up: stand-in %s has not published round %d's digests yet", sealer, seal["round"]
                )
                if await sleep_or_stop(stop, 1.0):
                    return False
                continue
            try:
                await fetch_state(self.node, sealer, self.global_model, seal["round"], digests)
                self.global_model.seal_hash = seal_digest(seal)
                self._take_budget(seal)
                self._saw_seal(seal["round"])
                log.info("caught up: holding θ after round %d", self.global_model.params_round)
                return True
            except (PeerRequestError, WireError) as exc:
                log.info("catch-up to round %d not ready (%s); retrying", seal["round"], exc)
            if await sleep_or_stop(stop, 1.0):
                return False
        return False
