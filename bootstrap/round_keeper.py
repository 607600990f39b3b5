"""The coordinator's half of a sync round: collect announcements, decide the seal
(`hetnode/protocol/sealing.py`), apply the same aggregate to its own copy of θ, write the round's seal line
(with θ's digests) to the history, and only then store the seal and publish the digests; serve sealed
payloads and state. Then it goes straight back to collecting the next
round: scoring, credit, evaluation, samples and checkpoints run beside it (`bootstrap/bookkeeping.py`).

After a restart (or a crash between checkpoints) the swarm may hold rounds the coordinator does not: its own
last seal is newer than its checkpoint, or a stand-in listed in the manifest sealed in its place while it was
away. Before it seals anything in this life it takes θ of that round from any replica (`catch_up`), trusting
only parameters whose layer digests match its own history (its rounds) or the stand-in's signed record (the
stand-in's rounds), never a vote of replicas. Once it has sealed, no other peer's seal or θ is ever adopted
(docs/security.md, "Who is trusted with what"): the swarm follows the coordinator's chain.

Credit follows from the protocol, not from claims: a sealed contribution earns the manifest's schedule
(H × batch × sequence tokens per replica, split over a chain's stages by the shards each delivered) in
proportion to the weight the seal gave it (earned by verified history), written by the worker once the
round's score is known. A ledger failure is logged and never stops sealing or applying.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import time
from collections import deque
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from bootstrap.bookkeeping import Bookkeeper, RoundWork, credit_rows, snapshot
from bootstrap.catch_up import CatchUp
from bootstrap.checkpoint_store import Restored, checkpoints_root, store
from bootstrap.ledger import Contribution, Ledger, credit_round
from bootstrap.run_state import HISTORY
from bootstrap.swarm_metrics import REPLICA_ROLES, SwarmMetrics
from bootstrap.verifier import replica_of
from hetnode.config import Config
from hetnode.net.node import SwarmNode
from hetnode.net.records import new_head_record
from hetnode.planning.rounds import (
    Announcement,
    ChainsAtOpen,
    chains_at_open,
    lost_records,
    replica_tokens,
    restarted_chains,
    shard_order,
)
from hetnode.protocol.payload_opener import payload_opener
from hetnode.protocol.sealing import SealedRound, Sealer
from hetnode.protocol.swarm_view import SwarmView
from hetnode.protocol.view import PeerDirectory
from hetnode.protocol.view_changes import ChangeLog
from hetnode.replica.global_model import GlobalModel
from hetnode.service.datadir import DataDir
from hetnode.service.lifecycle import sleep_or_stop, sleep_or_wake
from hetnode.service.presence import Presence
from hetnode.wire.round_history import merge_history
from hetnode.wire.sync_payload import DecodedPayload

log = logging.getLogger(__name__)

POLL_S = 0.5  # announcements are also nudged to us: this is the fallback and the deadline's resolution
HISTORY_KEPT = 500  # rounds kept in memory for the status page
HEAD_TTL_S = 3600.0  # rewritten every round; it outlives long rounds, and replicas compare round numbers


def read_history(data_dir: Path) -> list[dict[str, Any]]:
    """The sealed rounds in `DATA_DIR/rounds.jsonl`, each seal line with its round's evaluated line merged
    in (`hetnode/wire/round_history.py`; a torn last line after a crash is skipped)."""
    path = data_dir / HISTORY
    if not path.exists():
        return []
    rows = []
    for line in path.read_text().splitlines():
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            log.warning("skipping a damaged line in %s", path)
    return merge_history(rows)[-HISTORY_KEPT:]


class RoundKeeper:
    def __init__(
        self,
        config: Config,
        node: SwarmNode,
        presence: Presence,
        data_dir: DataDir,
        ledger: Ledger,
        metrics: SwarmMetrics | None = None,
        stand_ins: tuple[str, ...] = (),
        directory: PeerDirectory | None = None,
        restored: Restored | None = None,
        global_model: GlobalModel | None = None,
    ) -> None:
        """`directory`: the coordinator's reads of the peer records (one of our own if not given);
        `restored`: θ from the data dir's checkpoint (`checkpoint_store.restore`), taken over here;
        `global_model`: θ built already (`create` builds it off the event loop), else built here."""
        self.config = config
        self.node = node
        self.presence = presence
        self.data_dir = data_dir
        self.ledger = ledger  # credit for sealed contributions only (docs/sync.md, "Rounds over the network")
        self.metrics = metrics
        self.history: deque[dict[str, Any]] = deque(read_history(data_dir.path), maxlen=HISTORY_KEPT)
        self.stand_ins = tuple(sorted(set(stand_ins) - {node.identity.peer_id}))
        if global_model is None:
            global_model = GlobalModel(config, opener=payload_opener(node.run or "", config))
        self.global_model = global_model
        self.sealer = Sealer(config, node, self.global_model)
        self.sealed_in_this_life = False  # from then on, no other seal or θ is ever adopted
        after = (self._publish_theta, self._append_history, self._caught_up)
        self.catch_up = CatchUp(config, node, self.global_model, self.stand_ins, self.history, *after)
        # scores, credit, evaluation, samples and checkpoints, beside the seal, on a copy of θ of its own
        self.bookkeeping = Bookkeeper(
            config, ledger, checkpoints_root(data_dir.path), node.run, self._evaluated, metrics
        )
        self._rescued: dict[tuple[int, tuple[str, ...]], set[str]] = {}  # the last `_rescue` verdict
        self._caught_logged: set[str] = set()  # chain members caught lying, said in the log once
        self._names: dict[str, str] = {}  # display names from peer records, as last seen
        n = config.network
        self.view = directory or PeerDirectory(node, config, n.heartbeat_s, n.heartbeat_s)
        self.view.on_change = self.directory_changed
        self.changes = ChangeLog(node, HEAD_TTL_S)  # our view's recent steps, for replicas a few behind
        self._head: tuple[int, dict[str, str]] | None = None  # the round and digests the head states
        self._directory_changed = asyncio.Event()
        self._sealed = -1  # the newest round we sealed, in the head as soon as the seal is out
        self._expected_before: set[str] = set()  # whom the last look expected (`_expected`)
        self._opened: tuple[int, ChainsAtOpen] | None = None  # the live chains as a round opened
        self._load_checkpoint(restored)
        node.set_payloads(self.sealer.serve)
        node.set_state(self._serve_state)
        node.set_inclusion(self.included)
        self._announced = asyncio.Event()  # a replica nudged us: its announcement is in the DHT
        node.set_nudge_handler(self._on_nudge)

    @classmethod
    async def create(cls, config: Config, node: SwarmNode, *args: Any, **kwargs: Any) -> RoundKeeper:
        """A keeper (the arguments are `__init__`'s) whose θ is built in a worker thread: a big model's
        seeded initialisation takes tens of seconds (1b: a float64 draw of ~35 s), which on the event
        loop would stop the heartbeat past the coordinator's record lifetime."""
        theta = await asyncio.to_thread(GlobalModel, config, payload_opener(node.run or "", config))
        return cls(config, node, *args, global_model=theta, **kwargs)

    def included(self, round_: int, replica: str) -> bool | None:
        """Whether `replica` is in our seal of `round_` (None: not a round we sealed, or too old)."""
        entry = next((h for h in reversed(self.history) if h["round"] == round_), None)
        if entry is None or entry.get("caught_up_from"):
            return None
        return replica in entry["contributors"]

    def _on_nudge(self, peer: str, topic: str, round_: int) -> None:
        if topic == "announce":  # the path beside the DHT: its announcement, and its record if hidden
            self.sealer.pull_announcement(peer, then=self._announced.set)
            self.view.heard_from(peer)
            self._announced.set()

    def _serve_state(self, round_: int, shard: str) -> bytes | None:
        if round_ != self.global_model.params_round or shard not in self.global_model.shards:
            return None
        return self.global_model.state_payload(shard)

    async def _publish_theta(self, round_: int, digests: dict[str, str]) -> None:
        """Say which θ we hold: in our peer record, and in the small `head` entry that replicas check
        their own digests against after every round (reading it costs one entry, not the swarm's records)."""
        await self.presence.update(params_round=round_, layer_digests=digests, outer_step=round_)
        await self._store_head(round_, digests)

    async def _store_head(self, round_: int, digests: dict[str, str]) -> None:
        """Our θ's round and digests, with the digest of our view of the swarm and our clock: replicas
        skip reading every peer record while their view has that digest (`PeerDirectory`)."""
        self._head, directory = (round_, digests), self.view.digest
        await self.changes.publish()  # holds the step to `directory`: store it before a head names it
        head = new_head_record(round_, digests, directory, self._sealed)
        if not await self.node.store_own("head", head, HEAD_TTL_S):
            log.warning("round %d: the DHT did not accept our head record", round_)

    def directory_changed(self, before: SwarmView | None, after: SwarmView) -> None:
        """Our view of the swarm changed: log the step; store the log, then the head with the new digest."""
        self.changes.record(before, after)
        self._directory_changed.set()

    async def keep_head(self, stop: asyncio.Event) -> None:
        """Store the head again on each change of our view, and at least every half stable heartbeat, so
        that replicas can tell a current digest from the last word of a coordinator that went silent."""
        period_s = self.config.network.stable_heartbeat_s / 2
        while not await sleep_or_wake(stop, self._directory_changed, period_s):
            if self._head is not None:
                await self._store_head(*self._head)

    async def run(self, stop: asyncio.Event) -> None:
        digests = await asyncio.to_thread(self.global_model.digests)
        await self._store_head(self.global_model.params_round, digests)
        books = self.bookkeeping
        await asyncio.to_thread(books.build, self.global_model.params, self.global_model.params_round)
        for line in await asyncio.to_thread(books.recover, list(self.history)):
            self._evaluated(line)  # rounds a crash left sealed and never credited
        if books.verifier is not None:
            self.sealer.screen = books.verifier.screen
            self.sealer.rescue = self._rescue
            self.sealer.weigh = books.verifier.weights
        books.start()
        seen: dict[str, Announcement] = {}
        round_ = self.global_model.params_round + 1
        try:
            while not await sleep_or_wake(stop, self._announced, POLL_S):
                # rounds the swarm sealed without us (`catch_up`): taken before we seal anything
                newer = await self.catch_up.due(self.sealed_in_this_life)
                if newer is not None:
                    if not await self.catch_up.from_replicas(*newer):
                        await sleep_or_stop(stop, 1.0)
                    continue
                round_ = self.global_model.params_round + 1
                if any(a.round != round_ for a in seen.values()):
                    seen = {}
                try:
                    await self._poll(round_, seen)
                except Exception:  # a round that fails here must not end the coordinator; θ is untouched
                    log.exception("round %d: sealing failed; the round stays open", round_)
                    seen.clear()
                    await sleep_or_stop(stop, 1.0)
        finally:
            await books.close()  # the rounds waiting are credited; the phase in hand ends
            await asyncio.to_thread(self._checkpoint)  # a clean stop loses no round: the newest θ

    def _expected(self, view: SwarmView, round_: int) -> set[str]:
        """Whom the seal of `round_` waits for: the view's expected replicas, and those expected last time
        whose record the view lost without a word of leaving (a DHT that hid or dropped it: its records
        live seconds, its announcements come straight to us). One that is really gone misses this round
        and is not waited for again (`Sealer.waiting_for`); a pool's worker that its live chain goes on
        without is not waited for at all, nor a chain that dropped the round in flight
        (`restarted_chains`)."""
        expected = view.expected_contributors(round_, self.config.outer.overlap)
        # a pool's worker whose record is gone while its chain lives on without it is gone: the members
        # that still claim the chain commit to it and work without it (docs/chains.md, "Pools")
        left_pools = {
            peer
            for chain in view.chains()
            if chain.live
            for peer, _, _ in chain.layout
            if not any(peer in workers for workers in chain.workers)
        }
        lost = lost_records(self._expected_before, view.peers, view.departed, self.sealer.missed)
        expected |= lost - left_pools
        if self._opened is not None and self._opened[0] == round_:
            expected -= restarted_chains(self._opened[1], view.chains())
        self._expected_before = expected
        return expected

    async def _poll(self, round_: int, seen: dict[str, Announcement]) -> None:
        """One look at the announcements of `round_`; seal it when it is time."""
        await self.sealer.collect(round_, seen)
        if not seen:
            return
        view = await self.view.get()
        expected = self.sealer.waiting_for(self._expected(view, round_))
        if not self.sealer.ready(expected, seen):
            return
        started = time.monotonic()
        # a chain member another member caught lying to it is out of its chain's routing: its payload
        # (trained, if at all, on its own lies' echo) is not sealed either (docs/chains.md, "Pools")
        caught = {peer for chain in view.chains() for peer in chain.blamed} & set(seen)
        if caught - self._caught_logged:
            log.info("round %d: leaving out %s: caught lying to their chains", round_, sorted(caught))
            self._caught_logged |= caught
        seen = {peer: a for peer, a in seen.items() if peer not in caught}
        if not seen:
            return
        of = {peer: replica_of(peer, view.peers.get(peer)) for peer in seen}
        replicas = {peer: r.key for peer, r in of.items()}
        stages = {peer: r.stage for peer, r in of.items()}  # a stage's pool of workers counts as one stage
        # paced: replicas sitting out say how long their floor of steps takes; the budget lets them in
        floors = [
            r["floor_s"]
            for r in view.peers.values()
            if r["role"] in ("anchor", "stage") and isinstance(r.get("floor_s"), float)
        ]
        sealed = await self.sealer.decide(round_, seen, replicas, floors, stages)
        if sealed is None:
            return
        entry, work = await self._commit(sealed, started)
        # only now the seal goes out: a crash at any instant leaves the history holding the digests of
        # every round a replica can have applied (`CatchUp.trusted_digests` reads them after a restart)
        await self.sealer.publish(sealed, seen)
        self.node.prefer(self.sealer.trusted())  # replicas fetch the round from us: slots kept for them
        self._sealed = round_
        self._opened = (round_ + 1, chains_at_open(view.chains()))
        await self._publish_theta(round_, entry["layer_digests"])  # the head: replicas poll it, not the seal
        self.sealer.observe_arrivals(expected, seen)
        if self.metrics is not None:
            self.metrics.observe_seal(
                entry["payload_bytes"], entry["dense_bytes"], len(work.credits), entry["seal_seconds"]
            )
        self.bookkeeping.submit(work)
        log.info(
            "round %d sealed: %d contributions, %d excluded, %.3f s",
            round_,
            len(sealed.contributions),
            len(sealed.excluded),
            entry["seal_seconds"],
        )

    async def _commit(self, sealed: SealedRound, started: float) -> tuple[dict[str, Any], RoundWork]:
        """Commit the decided round to θ and write its seal line, digests in it, to disk (fsynced), before
        the seal is stored; returns the line and the bookkeeping worker's share of the round. The step
        was aggregated and checked when the round was decided: it cannot fail here. Nothing here waits for
        scoring, evaluation, sampling or a checkpoint."""
        round_ = sealed.record["round"]
        peers = (await self.view.get()).peers
        books = self.bookkeeping
        # the worker scores on θ before the step: a snapshot only when its own copy will not hold it
        base = (
            await asyncio.to_thread(snapshot, self.global_model.params) if books.needs_base(round_) else None
        )
        await asyncio.to_thread(self.global_model.commit, sealed.prepared)
        self.global_model.seal_hash = sealed.digest
        self.sealed_in_this_life = True
        # a peer that left right after announcing (its record is gone) keeps the name it last had
        if len(self._names) > 100_000:
            self._names.clear()
        self._names.update({peer: record["name"] for peer, record in peers.items()})
        members = {peer: replica_of(peer, peers.get(peer)) for peer, _ in sealed.contributions}
        stages = {p: (r.key, r.stage) for p, r in members.items() if r.stage is not None and r.key != p}
        credits = self.credits(sealed, self._names, stages)
        weights = {c["peer"]: c["weight"] for c in sealed.record["contributions"]}
        digests = await asyncio.to_thread(self.global_model.digests)
        entry = {
            "round": round_,
            "contributors": [peer for peer, _ in sealed.contributions],
            "excluded": sealed.excluded,
            "rejected": dict(sealed.rejected),  # the seal's screens; the verdicts come with the evaluation
            "scores": {},
            "verify_seconds": 0.0,  # the evaluated line says how long its scoring took
            # tokens credited by the schedule and the seal's weights: a replica's worth per anchor at full
            # weight, a chain's split over its stages (the evaluated line says what the score let through)
            "tokens": sum(c.tokens for c in credits),
            # each contribution's weight in the aggregate: earned by verified history (paced: × its steps)
            "weights": weights,
            # each contribution's inner steps (capped), and the budget the seal set for the rounds to come
            "steps": {c["peer"]: c["steps"] for c in sealed.record["contributions"]},
            "budget_s": sealed.record.get("budget_s"),
            "eval_loss": None,  # the evaluated line brings it
            "seal_seconds": round(time.monotonic() - started, 3),
            "layer_digests": digests,
            "seal_hash": sealed.digest,
            "time": time.time(),
            "payload_bytes": {
                role: sum(c.bytes_sent for c in credits if c.role == role) for role in REPLICA_ROLES
            },
            "dense_bytes": sum(self.global_model.dense_bytes(p) for _, p in sealed.contributions),
            "sample": None,
            "credits": credit_rows(credits),  # for a crash before the worker credits them
            "evaluated": False,
        }
        self._append_history(entry, durable=True)
        scorable = [(p, d) for p, d in sealed.valid if sealed.rejected.get(p) not in ("stale", "copy")]
        work = RoundWork(
            round_,
            step=sealed.prepared,
            base=base,
            base_round=round_ - 1,
            sealed=entry["contributors"],
            rejected=dict(sealed.rejected),
            scorable=scorable,
            replicas={peer: replica_of(peer, peers.get(peer)) for peer, _ in scorable},
            steps=sealed.steps,
            credits=credits,
            sealed_at=sealed.record["sealed_at"],
            digests=digests,
            seal_hash=sealed.digest,
        )
        return entry, work

    async def _caught_up(self, round_: int, digests: dict[str, str]) -> None:
        """θ of `round_` was taken from a replica: the worker takes a snapshot of it, evaluates, samples and
        checkpoints it (it has no contributions to score or credit)."""
        base = await asyncio.to_thread(snapshot, self.global_model.params)
        self.bookkeeping.submit(
            RoundWork(
                round_,
                base=base,
                base_round=round_,
                digests=digests,
                seal_hash=self.global_model.seal_hash,
                catch_up=True,
            )
        )

    def _evaluated(self, line: dict[str, Any]) -> None:
        """The worker's evaluated line for a round: appended to the history file, merged into our entry."""
        with open(self.data_dir.path / HISTORY, "a") as history:
            history.write(json.dumps(line) + "\n")
        entry = next((h for h in reversed(self.history) if h["round"] == line["round"]), None)
        if entry is not None:
            entry.update({k: v for k, v in line.items() if k != "round"})

    async def _rescue(
        self, round_: int, contributions: list[tuple[str, list[DecodedPayload]]], steps: dict[str, int]
    ) -> set[str]:
        """The peers among `contributions` whose work helps on its own (once per round and set of peers:
        the sealer asks again at every poll while the round stays open)."""
        key = (round_, tuple(sorted(peer for peer, _ in contributions)))
        verifier = self.bookkeeping.verifier
        if verifier is None:
            return set()
        if key not in self._rescued:
            peers = (await self.view.get()).peers
            replicas = {peer: replica_of(peer, peers.get(peer)) for peer, _ in contributions}
            self._rescued = {
                key: await asyncio.to_thread(
                    verifier.helps, round_, self.global_model.params, contributions, replicas, steps
                )
            }
        return self._rescued[key]

    def credits(
        self,
        sealed: SealedRound,
        names: dict[str, str],
        stages: Mapping[str, tuple[str, int]] | None = None,
    ) -> list[Contribution]:
        """The ledger rows of a sealed round, from the protocol: every contribution was validated, so its
        shards are the model's; tokens and steps follow from the manifest's schedule and the parameters of
        those shards (`bootstrap.ledger.credit_round`: a chain's tokens split over its stages in proportion
        to the parameters each delivered, a stage's over its pool's workers by the steps each served).
        `names` are advice: they earn nothing; `stages`: each chain member's (chain, stage)."""
        order = shard_order(self.config.model.n_layers)
        sizes = [(shard, self.global_model.dense_bytes([shard]) // 4) for shard in order]
        schedule, steps = replica_tokens(self.config), self.config.outer.inner_steps
        # credit goes with the weight earned by history (paced seals' weights also count steps)
        weights = sealed.earned or {c["peer"]: c["weight"] for c in sealed.record["contributions"]}
        full = self.config.outer.probation_rounds
        # paced: each replica's own steps, but none past H: steps are claims, and what an update shows of
        # them cannot be told from noise at this scale (docs/sync.md, "Paced rounds"), so a claim can
        # earn no more than one replica's schedule, as before paced rounds
        taken = {p: min(n, steps) for p, n in sealed.steps.items()} if self.config.outer.paced else None
        return credit_round(
            schedule, sizes, steps, sealed.contributions, names, weights, full, taken, stages, sealed.steps
        )

    def _append_history(self, entry: dict[str, Any], durable: bool = False) -> None:
        """`durable`: on disk before this returns, power cut included (a seal line, ahead of its seal)."""
        with open(self.data_dir.path / HISTORY, "a") as history:
            history.write(json.dumps(entry) + "\n")
            if durable:
                history.flush()
                os.fsync(history.fileno())
        self.history.append(entry)

    @property
    def eval_loss(self) -> float | None:
        """Of the global θ after the newest evaluated round in the history."""
        return next((h["eval_loss"] for h in reversed(self.history) if h.get("eval_loss") is not None), None)

    # --- checkpoints -----------------------------------------------------------------

    def _checkpoint(self) -> None:
        """θ as we hold it now (on stop; the worker writes the rounds' checkpoints)."""
        with self.bookkeeping.checkpoint_lock:
            folder = store(
                checkpoints_root(self.data_dir.path), self.global_model, self.config, self.node.run
            )
        if folder is not None:
            log.info("round %d: θ written to %s", self.global_model.params_round, folder)

    def _load_checkpoint(self, restored: Restored | None) -> None:
        """Take θ from `restored` (checked against the config by `checkpoint_store.restore`)."""
        if restored is None:
            return
        with torch.no_grad():
            for name, tensor in restored.params.items():
                self.global_model.params[name].copy_(tensor)
        restored.params.clear()  # one copy of θ in memory, not two
        self.global_model.params_round = restored.manifest.round
        self.global_model.changed()
        seal_hash = restored.manifest.seal_hash
        if seal_hash is None:  # converted from a checkpoint of before seals were chained: ask the history
            seal_hash = next(
                (
                    h.get("seal_hash")
                    for h in reversed(self.history)
                    if h["round"] == self.global_model.params_round
                ),
                None,
            )
        self.global_model.seal_hash = seal_hash
        log.info("global model restored at round %d from %s", self.global_model.params_round, restored.folder)
