"""The anchor role over the network: train H inner steps, announce the payload digests, wait for the seal,
fetch exactly the sealed payloads, check their digests, apply the same outer step as every replica.

Round t of an anchor (docs/sync.md, "Rounds over the network", docs/sync.md "Overlap"):
1. train in a worker thread from its working weights (the event loop keeps serving handlers and the
   heartbeat);
2. keep the encoded payload per shard in memory, serve it, announce `{round, shards: sha256, tokens}`;
   with `outer.overlap` the worker thread goes straight on with round t+1 while round t's payload is
   compressed on a thread of its own;
3. wait for the coordinator's seal of round t;
4. fetch every sealed contribution (its own from memory, others from any holder), verify each sha256
   against the seal, then apply all of them or none;
5. hand θ^t to the worker thread, which rebases onto it between two inner steps (keeping what it learned
   since announcing) and saves a consistent local state off the thread; in lockstep the next round only
   starts now;
6. publish `params_round` and `layer_digests` in its record: the check that replicas agree.
"""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path

from hetnode.config import Config
from hetnode.daemon.faults.strategy import HONEST, Faults
from hetnode.daemon.participant import RoundParticipant
from hetnode.daemon.rounds import AnchorTraining, TrainedRound, write_state
from hetnode.data.epochs import training_dataset
from hetnode.net.node import SwarmNode
from hetnode.net.records import MAX_ROUND_S
from hetnode.planning.rounds import busy_floor, floor_seconds
from hetnode.protocol.payload_opener import payload_opener
from hetnode.protocol.view import PeerDirectory
from hetnode.replica.global_model import GlobalModel, sha256_hex
from hetnode.service.metrics import PeerMetrics
from hetnode.service.presence import Presence
from hetnode.service.round_log import RoundRecord
from hetnode.service.state_writer import LatestStateWriter
from hetnode.training.local_rounds import Rebase, RebaseInbox, TrainingStopped

log = logging.getLogger(__name__)


class AnchorLoop:
    def __init__(
        self,
        config: Config,
        node: SwarmNode,
        presence: Presence,
        coordinator: str,
        device: str,
        state_path: Path,
        faults: Faults = HONEST,
        metrics: PeerMetrics | None = None,
        stand_ins: tuple[str, ...] = (),
        directory: PeerDirectory | None = None,
    ) -> None:
        """`state_path`: local state for restarts; its folder (the data dir) also gets the round log;
        `faults`: tests only, a hostile or faulty anchor (`hetnode.daemon.faults`); `stand_ins`: the
        manifest's stand-in sealers; `directory`: the daemon's reads of peer records."""
        self.config = config
        self.node = node
        self.presence = presence
        self.device = device
        self.state_path = state_path
        self.faults = faults
        self.metrics = metrics
        self.coordinator, self.stand_ins, self.directory = coordinator, stand_ins, directory
        # built by `run`, off the event loop (`_build`)
        self.global_model: GlobalModel
        self.rounds: RoundParticipant

    async def _build(self) -> AnchorTraining:
        """θ, the data and our working replica, each built in a worker thread: a big model's seeded
        initialisation takes tens of seconds (1b: two float64 draws of ~35 s), which on the event loop
        would stop our heartbeat past our record's lifetime. Then, on the loop, the round participant:
        from then on it serves our payloads."""
        c = self.config
        self.global_model = await asyncio.to_thread(GlobalModel, c, payload_opener(self.node.run or "", c))
        self.rounds = RoundParticipant(
            c,
            self.node,
            self.coordinator,
            self.global_model,
            may_stand_in=True,
            data_dir=self.state_path.parent,
            metrics=self.metrics,
            stand_ins=self.stand_ins,
            directory=self.directory,
        )
        dataset = await asyncio.to_thread(training_dataset, c)
        peer_id = self.node.identity.peer_id
        return await asyncio.to_thread(AnchorTraining, c, dataset, peer_id, self.device, self.faults)

    async def run(self, stop: asyncio.Event) -> None:
        training = await self._build()
        if await asyncio.to_thread(training.load_local_state, self.state_path, self.global_model):
            log.info(
                "resumed local state: round %d, %d inner steps, error-feedback norm %.6f",
                self.global_model.params_round,
                training.trainer.step,
                training.feedback_norm(),
            )
        await self.rounds.catch_up(stop)
        writer = LatestStateWriter(lambda state: write_state(self.state_path, state))
        training.on_rebased = writer.submit  # a consistent copy, taken in the training thread
        if self.config.outer.overlap:
            training.close_aside()
        inbox = RebaseInbox()
        inbox.post(await asyncio.to_thread(self._rebase, training, ()))
        task = self._train(training, self.global_model.params_round + 1, inbox)
        try:
            while not stop.is_set():
                trained = await task
                if trained.sat_out:  # paced, and too slow for the budget: the round goes on without us
                    if self.metrics is not None:
                        self.metrics.rounds_sat_out.inc()
                    await self.presence.update(floor_s=self._floor_s(training))  # the budget may let us in
                    if not await self.rounds.sit_out(trained.round, stop):
                        return
                    inbox.post(await asyncio.to_thread(self._rebase, training, ()))
                    task = self._train(training, self.global_model.params_round + 1, inbox)
                    continue
                closing = trained.closing
                if closing is not None:  # round t+1 trains while round t's payload is made, then synced
                    task = self._train(training, trained.round + 1, inbox)
                    trained.payloads = await asyncio.wrap_future(closing)
                trained.payloads = await self.faults.announced_payloads(
                    self.node, self.global_model, trained.round, trained.payloads, stop
                )
                announcement, record = self._announce(trained)
                if self.config.outer.overlap and closing is None:  # round t+1 trains while round t syncs
                    task = self._train(training, trained.round + 1, inbox)
                outcome = await self.rounds.take_part(announcement, stop, record)
                if outcome is None:
                    return
                if self.faults.after_apply(self.global_model):  # checked at once: a step could round it away
                    self.rounds.unchecked = self.global_model.params_round
                    await self.rounds.verify_agreement(stop)
                left_out = (trained.round,) if outcome.left_out else ()
                inbox.post(await asyncio.to_thread(self._rebase, training, left_out))
                if not self.config.outer.overlap:  # lockstep: the next round starts from the new θ
                    task = self._train(training, self.global_model.params_round + 1, inbox)
                await self.presence.update(
                    params_round=self.global_model.params_round,
                    layer_digests=self.global_model.digests(),
                    tokens=training.tokens,
                    outer_step=self.global_model.params_round,
                    utilization=self.rounds.utilization,
                    floor_s=self._floor_s(training),
                )
        except TrainingStopped:
            return
        finally:
            inbox.close()
            await asyncio.gather(task, return_exceptions=True)  # the thread stops at its next step
            await asyncio.to_thread(training.stop_closing)
            for rebase in inbox.drain():  # θ applied but not yet stood on: its state is the newest
                training.rebase(rebase)
            await asyncio.to_thread(writer.close)

    def _floor_s(self, training: AnchorTraining) -> float | None:
        """Paced: the seconds our floor of inner steps and the round's close take at our measured pace (in
        our record): the floor that keeps our steps at BUSY_SHARE of the round, however slow we are."""
        o = self.config.outer
        if not o.paced:
            return None
        floor = busy_floor(o.step_floor, o.step_cap, training.step_s, training.close_s)
        return floor_seconds(floor, training.step_s, MAX_ROUND_S, training.close_s or 0.0)

    def _train(self, training: AnchorTraining, round_: int, inbox: RebaseInbox) -> asyncio.Future:
        training.budget_s = self.rounds.round_budget_s  # paced: the newest budget a seal gave us
        return asyncio.ensure_future(asyncio.to_thread(training.train_round, round_, inbox))

    def _rebase(self, training: AnchorTraining, left_out: tuple[int, ...]) -> Rebase:
        """θ as we hold it now, for the training thread to stand on (a test's stale peer: older θ)."""
        theta = self.faults.train_from(self.global_model)
        next_round = self.global_model.params_round + 1
        return training.rebase_from(theta, next_round, left_out, self.rounds.last_contributors)

    def _announce(self, trained: TrainedRound) -> tuple[dict, RoundRecord]:
        """Sign and hold the round's payload; the announcement and the round's log line (sync to come)."""
        payloads = self.rounds.keep(trained.round, self.faults.payload_bytes(trained.payloads))
        digests = {shard: sha256_hex(data) for shard, data in payloads.items()}
        digests = self.faults.announced_digests(digests, payloads)
        announcement = {
            "round": trained.round,
            "shards": digests,
            "tokens": trained.tokens,  # this round's: what the ledger will credit
            "steps": trained.steps,
            "train_s": float(round(trained.timing.train_s, 3)),  # paced rounds learn the budget from it
        }
        timing = trained.timing
        log.info(
            "round %d trained in %.1f s (loss %.3f, %.1f s waiting for the round before): announcing",
            trained.round,
            timing.train_s,
            trained.loss,
            timing.wait_s,
        )
        upload = sum(len(data) for data in payloads.values())
        record = RoundRecord(
            trained.round,
            "anchor",
            round(timing.train_s, 3),
            trained.tokens,
            upload,
            steps=announcement["steps"],
            loss=trained.loss,
            started_at=timing.started_at,
            train_wait_s=round(timing.wait_s, 3),
            close_s=round(timing.close_s, 3),
            overlap=self.config.outer.overlap,
        )
        if self.metrics is not None and upload:
            self.metrics.set_compression("sparseloco", self.global_model.dense_bytes(payloads) / upload)
        return announcement, record
