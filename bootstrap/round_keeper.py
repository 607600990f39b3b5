"""The coordinator's half of a sync round: collect announcements, seal (`hetnode/daemon/sealing.py`), apply
the same aggregate to its own copy of θ, evaluate, checkpoint every K rounds, and serve sealed payloads
and state.

After a restart (or a crash between checkpoints) the swarm may hold rounds the coordinator does not: its
own last seal is newer than its checkpoint, or a stand-in listed in the manifest sealed in its place while
it was away. Before it seals anything in this life it takes θ of that round from any replica (`catch_up`),
trusting only parameters whose layer digests match its own history (its rounds) or the stand-in's
signed record (the stand-in's rounds), never a vote of replicas. Once it has sealed, no other peer's seal
or θ is ever adopted (TRUST §1): the swarm follows the coordinator's chain.

Credit follows from the protocol, not from claims: a sealed contribution earns the manifest's schedule
(H × batch × sequence tokens per replica, split over a chain's stages by the shards each delivered). A
ledger failure is logged and never stops sealing or applying.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections import deque
from pathlib import Path
from typing import Any

import torch

from bootstrap.catch_up import CatchUp
from bootstrap.checkpoint_store import Restored, checkpoints_root, store
from bootstrap.ledger import Contribution, Ledger, Verdict
from bootstrap.run_state import HISTORY
from bootstrap.samples import RoundSampler
from bootstrap.swarm_metrics import REPLICA_ROLES, SwarmMetrics
from bootstrap.verifier import Verifier, replica_of
from hetnode.config import Config
from hetnode.daemon.participant import payload_opener
from hetnode.daemon.sealing import SealedRound, Sealer
from hetnode.daemon.view import PeerDirectory, SwarmView
from hetnode.daemon.view_changes import ChangeLog
from hetnode.data.dataset import TokenDataset
from hetnode.model.decoder import build_model
from hetnode.net.node import SwarmNode
from hetnode.net.records import new_head_record
from hetnode.planning.rounds import Announcement, replica_tokens, seal_now, shard_order
from hetnode.replica.global_model import GlobalModel, base_fixed_embedding
from hetnode.service.datadir import DataDir
from hetnode.service.lifecycle import sleep_or_stop, sleep_or_wake
from hetnode.service.presence import Presence
from hetnode.wire.sync_payload import DecodedPayload

log = logging.getLogger(__name__)

POLL_S = 0.5  # announcements are also nudged to us: this is the fallback and the deadline's resolution
HISTORY_KEPT = 500  # rounds kept in memory for the status page
HEAD_TTL_S = 3600.0  # rewritten every round; it outlives long rounds, and replicas compare round numbers


def read_history(data_dir: Path) -> list[dict[str, Any]]:
    """The sealed rounds in `DATA_DIR/rounds.jsonl` (a torn last line after a crash is skipped)."""
    path = data_dir / HISTORY
    if not path.exists():
        return []
    entries = []
    for line in path.read_text().splitlines():
        try:
            entries.append(json.loads(line))
        except json.JSONDecodeError:
            log.warning("skipping a damaged line in %s", path)
    return entries[-HISTORY_KEPT:]


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
    ) -> None:
        """`directory`: the coordinator's reads of the peer records (one of our own if not given);
        `restored`: θ from the data dir's checkpoint (`checkpoint_store.restore`), taken over here."""
        self.config = config
        self.node = node
        self.presence = presence
        self.data_dir = data_dir
        self.ledger = ledger  # credit for sealed contributions only (DESIGN §3.5)
        self.metrics = metrics
        self.history: deque[dict[str, Any]] = deque(read_history(data_dir.path), maxlen=HISTORY_KEPT)
        self.stand_ins = tuple(sorted(set(stand_ins) - {node.identity.peer_id}))
        self.global_model = GlobalModel(config, opener=payload_opener(node.run or "", config))
        self.sealer = Sealer(config, node, self.global_model)
        self.sealed_in_this_life = False  # from then on, no other seal or θ is ever adopted
        self.catch_up = CatchUp(
            config,
            node,
            self.global_model,
            self.stand_ins,
            self.history,
            self._checkpoint,
            self._sample,
            self._publish_theta,
            self._append_history,
        )
        self.verifier: Verifier | None = None  # set up with the evaluator when `outer.verify` is on
        self.sampler: RoundSampler | None = None  # set up with the evaluator (it samples on that model)
        self._rescued: dict[tuple[int, tuple[str, ...]], set[str]] = {}  # the last `_rescue` verdict
        self._names: dict[str, str] = {}  # display names from peer records, as last seen
        n = config.network
        self.view = directory or PeerDirectory(node, config, n.heartbeat_s, n.heartbeat_s)
        self.view.on_change = self.directory_changed
        self.changes = ChangeLog(node, HEAD_TTL_S)  # our view's recent steps, for replicas a few behind
        self._head: tuple[int, dict[str, str]] | None = None  # the round and digests the head states
        self._directory_changed = asyncio.Event()
        self._sealed = -1  # the newest round we sealed, in the head as soon as the seal is out
        self._load_checkpoint(restored)
        node.set_payloads(self.sealer.serve)
        node.set_state(self._serve_state)
        node.set_inclusion(self.included)
        self._announced = asyncio.Event()  # a replica nudged us: its announcement is in the DHT
        node.set_nudge_handler(self._on_nudge)

    def included(self, round_: int, replica: str) -> bool | None:
        """Whether `replica` is in our seal of `round_` (None: not a round we sealed, or too old)."""
        entry = next((h for h in reversed(self.history) if h["round"] == round_), None)
        if entry is None or entry.get("caught_up_from"):
            return None
        return replica in entry["contributors"]

    def _on_nudge(self, peer: str, topic: str, round_: int) -> None:
        if topic == "announce":
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
        evaluator = await asyncio.to_thread(self._build_evaluator)
        self.sampler = RoundSampler(
            self.config.samples, self.config.run.seed, self._dataset.tokenizer, self._model
        )
        if self.config.outer.verify:
            self.verifier = Verifier(self.config, self._dataset, self._model)
            self.sealer.screen = self.verifier.screen
            self.sealer.rescue = self._rescue
        seen: dict[str, Announcement] = {}
        round_ = self.global_model.params_round + 1
        try:
            while not await sleep_or_wake(stop, self._announced, POLL_S):
                # rounds the swarm sealed without us (`catch_up`): taken before we seal anything
                newer = await self.catch_up.due(self.sealed_in_this_life)
                if newer is not None:
                    if not await self.catch_up.from_replicas(*newer, evaluator):
                        await sleep_or_stop(stop, 1.0)
                    continue
                round_ = self.global_model.params_round + 1
                if any(a.round != round_ for a in seen.values()):
                    seen = {}
                try:
                    await self._poll(round_, seen, evaluator)
                except Exception:  # a round that fails here must not end the coordinator; θ is untouched
                    log.exception("round %d: sealing failed; the round stays open", round_)
                    seen.clear()
                    await sleep_or_stop(stop, 1.0)
        finally:
            await asyncio.to_thread(self._checkpoint)  # a clean stop loses no round

    async def _poll(self, round_: int, seen: dict[str, Announcement], evaluator: Any) -> None:
        """One look at the announcements of `round_`; seal it when it is time."""
        await self.sealer.collect(round_, seen)
        if not seen:
            return
        expected = self.sealer.waiting_for((await self.view.get()).expected_contributors(round_))
        if not seal_now(expected, seen, time.monotonic(), self.sealer.deadline.seconds):
            return
        started = time.monotonic()
        sealed = await self.sealer.seal(round_, seen)
        if sealed is None:
            return
        self._sealed = round_
        if self._head is not None:  # replicas poll the head for this, not the (O(R)-byte) seal
            await self._store_head(*self._head)
        self.sealer.observe_arrivals(expected, seen)
        await self._record(sealed, started, evaluator)

    async def _record(self, sealed: SealedRound, started: float, evaluator: Any) -> None:
        """Score the round's contributions (on θ before the step), apply the sealed round to the
        coordinator's θ, credit the verified contributions, evaluate, checkpoint, append to the history.
        The step was aggregated and checked before the seal was published: it cannot fail here."""
        round_ = sealed.record["round"]
        peers = (await self.view.get()).peers
        verdicts = await self._verify(sealed, peers)
        await asyncio.to_thread(self.global_model.commit, sealed.prepared)
        self.global_model.seal_hash = sealed.digest
        self.sealed_in_this_life = True
        # a peer that left right after announcing (its record is gone) keeps the name it last had
        if len(self._names) > 100_000:
            self._names.clear()
        self._names.update({peer: record["name"] for peer, record in peers.items()})
        names = self._names
        refused = {v.peer for v in verdicts if v.reason is not None}
        credits = [c for c in self.credits(sealed, names) if c.peer not in refused]
        try:
            await asyncio.to_thread(self.ledger.record_round, round_, sealed.record["sealed_at"], credits)
            await asyncio.to_thread(self.ledger.record_verdicts, verdicts)
        except Exception:  # the ledger is a view of the rounds: its failure must not stop them
            log.exception("round %d: the ledger refused the round's credits", round_)
        eval_loss = await asyncio.to_thread(evaluator, self.global_model)
        sample = await self._sample(round_)
        if round_ % self.config.outer.checkpoint_every_rounds == 0:
            await asyncio.to_thread(self._checkpoint)
        digests = self.global_model.digests()
        await self._publish_theta(round_, digests)
        entry = {
            "round": round_,
            "contributors": [peer for peer, _ in sealed.contributions],
            "excluded": sealed.excluded,
            "rejected": {v.peer: v.reason for v in verdicts if v.reason is not None},
            "scores": {v.peer: round(v.score, 4) for v in verdicts if v.score is not None},
            "verify_seconds": round(self.verifier.last_seconds, 3) if self.verifier else 0.0,
            # tokens trained by the schedule: a replica's worth per anchor, a chain's split over its stages
            "tokens": sum(c.tokens for c in credits),
            "eval_loss": eval_loss,
            "seal_seconds": round(time.monotonic() - started, 3),
            "layer_digests": digests,
            "seal_hash": sealed.digest,
            "time": time.time(),
            "payload_bytes": {
                role: sum(c.bytes_sent for c in credits if c.role == role) for role in REPLICA_ROLES
            },
            "dense_bytes": sum(self.global_model.dense_bytes(p) for _, p in sealed.contributions),
            "sample": sample,  # a few tokens from θ after this round, for people to read
        }
        self._append_history(entry)
        if self.metrics is not None:
            self.metrics.observe_round(
                entry["payload_bytes"], entry["dense_bytes"], len(credits), eval_loss, entry["seal_seconds"]
            )
        log.info(
            "round %d sealed: %d contributions, %d excluded, eval loss %.4f",
            round_,
            len(sealed.contributions),
            len(sealed.excluded),
            eval_loss,
        )

    async def _rescue(self, round_: int, contributions: list[tuple[str, list[DecodedPayload]]]) -> set[str]:
        """The peers among `contributions` whose work helps on its own (once per round and set of peers:
        the sealer asks again at every poll while the round stays open)."""
        key = (round_, tuple(sorted(peer for peer, _ in contributions)))
        if self.verifier is None:
            return set()
        if key not in self._rescued:
            peers = (await self.view.get()).peers
            replicas = {peer: replica_of(peer, peers.get(peer)) for peer, _ in contributions}
            self._rescued = {
                key: await asyncio.to_thread(
                    self.verifier.helps, round_, self.global_model.params, contributions, replicas
                )
            }
        return self._rescued[key]

    async def _verify(self, sealed: SealedRound, peers: dict[str, dict]) -> list[Verdict]:
        """Score the round's valid contributions (stale and copied ones have their reason already) and
        judge each: what the ledger keeps and what it credits."""
        if self.verifier is None:
            return []
        round_ = sealed.record["round"]
        replicas = {peer: replica_of(peer, peers.get(peer)) for peer, _ in sealed.valid}
        scorable = [(p, d) for p, d in sealed.valid if sealed.rejected.get(p) not in ("stale", "copy")]
        try:
            scores = await asyncio.to_thread(
                self.verifier.score, round_, self.global_model.params, scorable, replicas
            )
        except Exception:  # scoring must not stop the round: its contributions stay unscored
            log.exception("round %d: scoring failed", round_)
            scores = {}
        sealed_peers = [peer for peer, _ in sealed.contributions]
        verdicts = self.verifier.verdicts(round_, sealed_peers, sealed.rejected, scores)
        for v in verdicts:
            if v.reason is not None:
                log.info("round %d: no credit for %s (%s, average %s)", round_, v.peer, v.reason, v.average)
        return verdicts

    def credits(self, sealed: SealedRound, names: dict[str, str]) -> list[Contribution]:
        """The ledger rows of a sealed round, from the protocol: every contribution was validated, so its
        shards are the model's; tokens and steps follow from the manifest's schedule and those shards.
        `names` (display names from the peers' records) are advice: they earn nothing."""
        schedule = replica_tokens(self.config)
        order = shard_order(self.config.model.n_layers)
        n = len(order)
        credits = []
        for peer, payloads in sealed.contributions:
            # shards [first, first + count) of the model's order: a chain's stages cover [0, n) between them,
            # so their integer shares telescope to exactly one replica's schedule
            first, count = min(order.index(shard) for shard in payloads), len(payloads)
            credits.append(
                Contribution(
                    peer=peer,
                    name=names.get(peer) or peer[-8:],
                    role="anchor" if count == n else "stage",
                    tokens=schedule * (first + count) // n - schedule * first // n,
                    inner_steps=self.config.outer.inner_steps,
                    bytes_sent=sum(len(data) for data in payloads.values()),
                )
            )
        return credits

    def _append_history(self, entry: dict[str, Any]) -> None:
        with open(self.data_dir.path / HISTORY, "a") as history:
            history.write(json.dumps(entry) + "\n")
        self.history.append(entry)

    async def _sample(self, round_: int) -> dict[str, Any] | None:
        """A short text from θ after `round_` (off the event loop, like evaluation); its failure is logged
        and never stops the round."""
        if self.sampler is None or not self.sampler.enabled:
            return None
        try:
            return await asyncio.to_thread(self.sampler.sample, self.global_model.params, round_)
        except Exception:
            log.exception("round %d: sampling failed", round_)
            return None

    @property
    def eval_loss(self) -> float | None:
        """Of the global θ after the newest round in the history."""
        return self.history[-1]["eval_loss"] if self.history else None

    # --- evaluation and checkpoints -----------------------------------------------------------------

    def _build_evaluator(self):
        dataset = TokenDataset.build(self.config.data, self.config.model.vocab_size, self.config.run.seed)
        model = build_model(self.config.model, seed=self.config.run.seed)
        model.fixed_embedding = base_fixed_embedding(self.config)  # the architecture anchors train
        self._dataset, self._model = dataset, model  # the verifier scores with them (never at once)
        batches = dataset.eval_batches(self.config.train.eval_batches)

        @torch.no_grad()
        def evaluate(global_model: GlobalModel) -> float:
            for name, param in model.named_parameters():
                param.copy_(global_model.params[name])
            model.eval()
            return sum(model.loss(x, y).item() for x, y in batches) / len(batches)

        return evaluate

    def _checkpoint(self) -> None:
        folder = store(checkpoints_root(self.data_dir.path), self.global_model, self.config, self.node.run)
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
