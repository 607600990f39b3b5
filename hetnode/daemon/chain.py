"""The stage role over the network: one member of a chain running the asynchronous 1F1B pipeline over
hivemind P2P streams, then taking part in the sealed round with its own layers (docs/chains.md, "Asynchronous
1F1B with weight stashing", §3.5).

A stage may be a pool of workers with the same layers (docs/chains.md, "Pools and routing"); between two
stages there is one duplex stream per pair of workers, opened by the earlier one (`chain_links`):
activation frames (subspace coefficients in bf16 with token ids and targets) go down the link the
routing picks, activation-gradient frames come back up the same link. The first stage reads the chain's
data slot; every worker but the last stage's keeps at most `stage_window` micro-batches unanswered (P − s
by default: the 1F1B schedule, whose weight delay is τ_s = P−1−s, per worker whatever the routing) and
holds a new one back until a gradient came back. Weight stashing in `StageWorker` makes the schedule
asynchronous without changing the math; each round's log records the weight delays the stage saw.

A round is H micro-batches (paced: as many as fit): the first stage stops feeding after H; a worker whose
micro-batches are all answered ends the round on each of its links downstream with the count it sent
there (`end` frames), and a worker that every live link upstream ended, with all it received answered, is
done; it encodes Δ of its own shards and announces. In lockstep it then waits for the seal and
applies it before the next round; with `outer.overlap` the round syncs in a task of its own while the
first stage feeds the next round's micro-batches and later stages accept them (docs/sync.md "Overlap").
Each stage stands on the new θ when its own apply is done, between two micro-batches, keeping its progress;
the round's T_fix' stays the one the first stage named (its drift frame: a θ round, whose embedding every
stage holds) for every stage until the next round. Frames
carry their round; at most one round is unapplied: a round is compressed only once θ of the round before
is stood on (else the stage waits, and that wait is what utilisation counts).

Anything wrong with a neighbour (a frame that fails validation, a gradient the stage refuses to step on,
a stream that breaks, a member whose record expired) loses that link: its micro-batches in flight go to
another worker of its pool. When a whole neighbouring stage is gone the chain breaks: in-flight work is
dropped, θ is untouched, and the peer daemon says so in its record: at the next boundary the chain goes on
with a spare in the empty stage, or dissolves (docs/chains.md, "When a member leaves").
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from hetnode.algo.sparseloco import tensors_norm
from hetnode.config import Config
from hetnode.daemon.chain_links import (
    ChainBroken,
    ChainLayout,
    Link,
    LinkFailed,
    Neighbours,
    Routed,
)
from hetnode.daemon.faults.strategy import HONEST, Faults
from hetnode.daemon.feedback_handoff import FeedbackHandoff, ReadView, take_feedback
from hetnode.daemon.participant import RoundParticipant
from hetnode.daemon.rounds import write_state
from hetnode.daemon.stage_training import StageTraining, drift_refusal
from hetnode.data.epochs import training_dataset
from hetnode.errors import UpdateRefused, WireError
from hetnode.net.node import SwarmNode
from hetnode.net.records import MAX_ROUND_S
from hetnode.planning.rounds import another_step, floor_seconds, round_budget_left
from hetnode.planning.routing import NormWatch, gradients_agree, odd_one_out
from hetnode.protocol.payload_opener import payload_opener
from hetnode.protocol.view import PeerDirectory, SwarmView
from hetnode.replica.global_model import GlobalModel, sha256_hex
from hetnode.service.lifecycle import sleep_or_stop
from hetnode.service.metrics import PeerMetrics
from hetnode.service.presence import Presence
from hetnode.service.round_log import RoundRecord
from hetnode.service.state_writer import LatestStateWriter
from hetnode.training.gradient_checks import agreement, norm_ratio
from hetnode.training.local_rounds import Rebase
from hetnode.training.schedule import stage_window
from hetnode.training.stage_round import stage_part
from hetnode.training.stage_worker import Frame
from hetnode.wire.activation_frame import (
    DecodedFrame,
    FrameKind,
    decode_frame,
    encode_drift,
    encode_frame,
    encode_round_end,
    frame_size_limit,
)

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)


def reason_to_leave(view: SwarmView, chain: str, me: str) -> str | None:
    """Why the records say our training in `chain` is over (None: it goes on)."""
    status = next((c for c in view.chains() if c.chain == chain), None)
    if status is None or not status.live:
        return "the records say the chain is not live (a member left or says it broke)"
    if me in status.blamed:
        return "another member of the chain says we sent what no honest stage sends"
    return None


class ChainLoop:
    def __init__(
        self,
        config: Config,
        node: SwarmNode,
        presence: Presence,
        coordinator: str,
        layout: ChainLayout,
        data_dir: Path,
        device: str = "cpu",
        metrics: PeerMetrics | None = None,
        directory: PeerDirectory | None = None,
        faults: Faults = HONEST,
        predecessors: Sequence[str] = (),
    ) -> None:
        """`data_dir` gets the round log; `directory`: the daemon's shared reads of the peer records;
        `faults`: tests only, a stage whose frames are hostile (`hetnode.daemon.faults`); `predecessors`:
        a spare's, who held our stage and left, and may hand us its error feedback."""
        self.config = config
        self.predecessors = tuple(predecessors)
        self.node = node
        self.presence = presence
        self.layout = layout
        self.data_dir = data_dir
        self.device = device
        self.metrics = metrics
        self.faults = faults
        self.state_path = data_dir / f"stage-state-{node.run}.pt"  # for restarts, as an anchor keeps one
        self.compute_s = 0.0  # in forward and backward passes, since the chain started
        self.peer_id = node.identity.peer_id
        # the stage's slice of θ only: its memory and its sealed download scale with its layers
        self.coordinator, self.directory = coordinator, directory
        # built by `run`, off the event loop (`_build`)
        self.global_model: GlobalModel
        self.rounds: RoundParticipant
        self.drift_base: tuple[int, int] | None = None  # (round, the θ round its T_fix' comes from)
        self.training: StageTraining | None = None
        self.syncing: asyncio.Task[bool] | None = None  # the round announced last, while the next trains
        self.last_round = -1  # the newest round this stage trained (announced, or sealed before its end)
        self.writer = LatestStateWriter(lambda state: write_state(self.state_path, state))
        self.compute = asyncio.Lock()  # one forward or backward at a time on this stage
        self.round_ = -1  # the round being trained; frames of other rounds wait or break the chain
        self.round_open = asyncio.Event()
        self._round_requested = asyncio.Event()  # stages after the first: a frame of a new round arrived
        self._requested_round = -1
        self.round_done = asyncio.Event()
        self.backwards = 0  # micro-batches of the open round back-propagated here
        self.received = 0  # micro-batches of the open round that arrived here (stages after the first)
        # first stage: the micro-batches it fed in the open round, once it stopped feeding
        self.target: int | None = None
        self.mb_s: float | None = None  # paced, first stage: the time between two micro-batches fed
        self.drain_s = 0.0  # paced, first stage: from the last micro-batch fed to the round's end, last round
        self.window: asyncio.Semaphore | None = None
        self.failed: asyncio.Future[str] | None = None
        self.links = Neighbours(
            node, layout, self._up_mbps, self._say_blame, config.pipeline.audit_share, config.outer.step_cap
        )
        self.links.on_lost = self._lost_link
        self.links.on_spare_answer = self._spare_answer
        # gradients back from downstream, waiting for an older micro-batch's (`_step_in_order`)
        self.held_grads: dict[int, tuple[Link, DecodedFrame, Routed]] = {}
        # held gradients far off the pool's norms, until another worker answered the same micro-batch
        self.suspects: dict[int, str] = {}
        # a pool's cheap statistical check: each link's frames against the other workers' (`NormWatch`)
        self.norms = {"act": NormWatch(), "grad": NormWatch()}
        self._closing = asyncio.Event()

    # --- lifecycle ---------------------------------------------------------------------------------

    async def _build(self) -> None:
        """Our slice of θ in a worker thread (a big model's seeded initialisation would stop the heartbeat on
        the event loop), then the round participant that serves our payloads. Our slice is our layers, and
        θ's embedding when boundaries are compressed: each stage builds the round's T_fix' from it."""
        c, layout = self.config, self.layout
        part = stage_part(layout.splits, layout.index, c.pipeline.compression != "none")
        self.global_model = await asyncio.to_thread(
            GlobalModel, c, payload_opener(self.node.run or "", c), part
        )
        self.rounds = RoundParticipant(
            c,
            self.node,
            self.coordinator,
            self.global_model,
            may_stand_in=False,
            data_dir=self.data_dir,
            metrics=self.metrics,
            directory=self.directory,
        )

    async def run(self, stop: asyncio.Event) -> str:
        """Train with the chain until stopped or broken; returns why it ended."""
        self.failed = asyncio.get_running_loop().create_future()
        await self._build()
        layout = self.layout
        dataset = None
        if layout.first:
            dataset = await asyncio.to_thread(training_dataset, self.config)
        self.training = await asyncio.to_thread(
            StageTraining,
            self.config,
            layout.splits,
            layout.index,
            layout.lineage or layout.chain,
            dataset,
            self.device,
        )
        restored = await asyncio.to_thread(self.training.load_local_state, self.state_path, self.global_model)
        if restored is not None:
            log.info(
                "resumed local state (%s): round %d, error-feedback norm %.6f",
                "θ, error feedback and optimiser" if restored == "all" else "error feedback of held layers",
                self.global_model.params_round,
                self.training.feedback_norm(),
            )
        if not layout.first:
            self.node.set_stage_acceptor(self._accept_upstream)
        tasks: list[asyncio.Task] = []
        # a spare: beside the catch-up and the rounds (nothing waits for it), cancelled when we stop
        taking = None
        if self.predecessors:
            taking = asyncio.create_task(self._take_feedback(), name="chain-feedback")
        try:
            await self.rounds.catch_up(stop)
            await self._rebase(())
            await self._connect(stop)
            tasks = [asyncio.create_task(self._watch_members(stop), name="chain-watch")]
            for link in self.links.downs.values():
                tasks.append(asyncio.create_task(self._serve(link, self._read_gradients), name="chain-grads"))
            for link in self.links.ups.values():
                tasks.append(
                    asyncio.create_task(self._serve(link, self._read_activations), name="chain-acts")
                )
            for task in tasks:
                task.add_done_callback(self._task_ended)
            rounds = asyncio.create_task(self._run_rounds(stop), name="chain-rounds")
            stopped = asyncio.create_task(stop.wait())
            tasks += [rounds, stopped]  # cancelled below however we leave, a cancellation of run() included
            await asyncio.wait([rounds, stopped, self.failed], return_when=asyncio.FIRST_COMPLETED)
            for waiter in (rounds, stopped):
                waiter.cancel()
            await asyncio.gather(rounds, stopped, return_exceptions=True)
            error = rounds.exception() if rounds.done() and not rounds.cancelled() else None
            if isinstance(error, ChainBroken):
                self._broken(error)
            elif error is not None:
                self._fail(f"round loop failed: {error!r}")
        except ChainBroken as exc:
            self._broken(exc)
        finally:
            self._closing.set()
            if not layout.first:
                self.node.set_stage_acceptor(None)
            if taking is not None:
                tasks.append(taking)
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            self.links.close()
            if self.training is not None:
                self.training.worker.drop_in_flight()
            await asyncio.to_thread(self.writer.close)
        reason = self.failed.result() if self.failed.done() else "stopped"
        if reason != "stopped":
            log.warning("chain %s: %s; in-flight work dropped, θ untouched", layout.chain, reason)
        return reason

    async def _take_feedback(self) -> None:
        """A spare: the error feedback our stage's predecessor left (`feedback_handoff`), added to ours at
        our next round's end; without it we start from zero, as a new chain does."""
        training = self.training
        names = {name for names in training.shards.values() for name in names}
        theta = {name: self.global_model.params[name] for name in names}
        taken = await take_feedback(self.node, self.config, self.predecessors, training.shards, theta)
        if taken is None:
            log.info("chain %s: our stage starts with no error feedback", self.layout.chain)
            return
        peer, feedback = taken
        training.hand_over(feedback)
        norm, slice_norm = await asyncio.to_thread(lambda: (tensors_norm(feedback), tensors_norm(theta)))
        log.info(
            "took our stage's error feedback from %s (norm %.6f, %.4f of our slice of θ's)",
            peer[-8:],
            norm,
            norm / max(slice_norm, 1e-30),
        )

    def handoff(self, read_view: ReadView) -> FeedbackHandoff | None:
        """What we leave to the spare that takes our stage (None: nothing trained yet)."""
        training = self.training
        names = {name for names in training.shards.values() for name in names} if training else set()
        if training is None or not names or not names <= set(training.feedback.buffers):
            return None  # no round compressed yet: nothing owed
        layout = self.layout
        split = layout.splits[layout.index]
        return FeedbackHandoff(
            self.peer_id,
            layout.index,
            (split.start, split.stop - 1),
            [peer for workers in layout.pools for peer in workers],
            layout.lineage or layout.chain,
            dict(training.feedback.buffers),
            training.shards,
            self.global_model.params_round,
            read_view,
        )

    def _fail(self, reason: str) -> None:
        if self.failed is not None and not self.failed.done():
            self.failed.set_result(reason)

    @property
    def blamed(self) -> str | None:
        """The first neighbour we caught sending what no honest stage sends (said in our record: the chain
        goes on without it)."""
        return self.links.blamed

    @property
    def bytes_sent(self) -> int:  # activation and gradient frames, since the chain started
        return self.links.bytes_sent

    @property
    def bytes_received(self) -> int:
        return self.links.bytes_received

    @property
    def send_s(self) -> float:  # writing frames to neighbours, since the chain started
        return self.links.send_s

    def _broken(self, exc: ChainBroken) -> None:
        self._fail(str(exc))

    async def _say_blame(self, peer: str, reason: str) -> None:
        """Say in our record whom we caught lying: every member then drops it (`ChainStatus.workers`)."""
        await self.presence.update(chain_blame=peer)

    def _task_ended(self, task: asyncio.Task) -> None:
        if task.cancelled():
            return
        exc = task.exception()
        if isinstance(exc, ChainBroken):
            self._broken(exc)
        elif exc is not None:  # a task that returns was stopped
            self._fail(str(exc))

    async def _connect(self, stop: asyncio.Event) -> None:
        """Link up with the working members of the neighbouring stages (`Neighbours.connect`)."""
        view = await self.rounds.view.get()
        await self.links.connect(self._working(view), stop)
        layout = self.layout
        log.info(
            "chain %s: stage %d of %d connected (layers %d..%d; %d worker(s) upstream, %d downstream)",
            layout.chain,
            layout.index,
            layout.stages,
            layout.splits[layout.index].start,
            layout.splits[layout.index].stop - 1,
            len(self.links.ups),
            len(self.links.downs),
        )

    def _working(self, view: SwarmView) -> set[str]:
        """The members to link up with: the whole layout, but for those the records say stopped working
        in the chain or were caught lying (one not claiming it yet may be a moment behind us)."""
        members = {p for pool in self.layout.pools for p in pool}
        status = next((c for c in view.chains() if c.chain == self.layout.chain), None)
        if status is None:
            return members
        return members - {p for p, why in status.dropped.items() if why != "left"}

    async def _accept_upstream(
        self, peer: str, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        if await self.links.accept(peer, reader, writer):
            await self._closing.wait()  # the stream lives as long as the chain

    async def _watch_members(self, stop: asyncio.Event) -> None:
        """Break the chain when the records say it is not live any more (a whole stage left) or that another
        member caught us lying (its neighbours no longer route to us: only its records tell us so, as
        the streams it closed may stay open at our end); lose the links to neighbours that stopped working
        in it (left, said their training ended, caught lying)."""
        me = self.node.identity.peer_id
        while not await sleep_or_stop(stop, self.config.network.heartbeat_s):
            view = await self.rounds.view.get()
            why = reason_to_leave(view, self.layout.chain, me)
            if why is not None:
                raise ChainBroken(why)
            await self.links.drop_gone(view)

    async def _serve(self, link: Link, reader: Callable[[Link], Any]) -> None:
        """Read `link` with `reader` until it fails; then it is lost (`Neighbours.lose`: ChainBroken when it
        was the last of its stage's)."""
        try:
            await reader(link)
        except LinkFailed as exc:
            await self.links.lose(link, str(exc), blame=exc.blame)

    def _lost_link(self, link: Link) -> None:
        self.norms["act"].forget(link.peer)
        self.norms["grad"].forget(link.peer)
        for mb in list(self.suspects):
            held = self.held_grads[mb]
            if held[0] is link:  # its micro-batch goes to another worker with the link's others (`lose`)
                del self.suspects[mb], self.held_grads[mb]
                self.links.routed[mb] = held[2]
            elif mb not in self.links.audits:  # the worker asked for a second opinion was this one
                task = asyncio.get_running_loop().create_task(self._without_opinion(mb))
                task.add_done_callback(self._task_ended)
        self._check_done()  # a round may wait for nothing more from a worker upstream that left

    def _spare_answer(self, mb: int, link: Link, grad: torch.Tensor) -> None:
        """Re-routed `mb` is answered by the gradient `link`'s worker sent for its copy (`route`)."""
        frame = DecodedFrame("grad", self.round_, mb, grad, None, None)
        task = asyncio.get_running_loop().create_task(self._serve_gradient(link, frame))
        task.add_done_callback(self._task_ended)

    async def _serve_gradient(self, link: Link, frame: DecodedFrame) -> None:
        try:
            await self._take_gradient(link, frame)
        except LinkFailed as exc:
            await self.links.lose(link, str(exc), blame=exc.blame)

    # --- rounds ------------------------------------------------------------------------------------

    async def _run_rounds(self, stop: asyncio.Event) -> None:
        try:
            while not stop.is_set():
                if not await self._one_round(stop):
                    return
        finally:
            if self.syncing is not None:
                self.syncing.cancel()
                await asyncio.gather(self.syncing, return_exceptions=True)

    async def _one_round(self, stop: asyncio.Event) -> bool:
        """Train a round, compress and announce it, and sync it (in lockstep before returning, with overlap
        beside the next round). False when stopped."""
        training = self.training
        assert training is not None
        round_ = await self._next_round(stop)
        if round_ is None:
            return False
        started, tokens_before = time.monotonic(), training.tokens
        started_at = time.time()  # wall clock, for compute utilisation (round_log)
        sent_before, received_before = self.bytes_sent, self.bytes_received
        compute_before, send_before = self.compute_s, self.send_s
        drift_base = self._drift_of(round_)
        if not await self._hold_embedding_after(drift_base, stop):
            return False
        async with self.compute:
            await asyncio.to_thread(training.begin_round, round_, drift_base)
        self.backwards = self.received = 0
        self.target = None
        self.links.new_round()
        self.round_done.clear()
        # a pool of W after us: W times the window, one step per W gradients (`StageWorker.accumulate`)
        width = training.worker.accumulate = self.layout.width_after
        self.window = asyncio.Semaphore(
            width * stage_window(self.layout.stages, self.layout.index, self.config.pipeline.max_in_flight)
        )
        delays_before = len(training.worker.staleness)
        self.round_ = round_
        self.last_round = round_
        self.round_open.set()
        if self.layout.first:
            await self._feed(round_)
        fed = time.monotonic()
        await self._until(self.round_done)
        async with self.compute:  # the round's last, partial group of gradients
            await asyncio.to_thread(training.worker.flush)
        self.drain_s = time.monotonic() - fed
        trained_s = time.monotonic() - started
        for link in self.links.live(self.links.downs):  # all answered: each link's count is final
            await self.links.send(link, encode_round_end(round_, link.served))
        # at most one unapplied round: this one is compressed on θ of the round before
        waited = time.monotonic()
        if not await self._settle_sync(stop) or not await self._stand_on(round_ - 1, stop):
            return False
        wait_s = time.monotonic() - waited
        if training.base >= round_:
            # Sealed without us meanwhile. An anchor would announce its work as the round now open, but a
            # chain's rounds are its first stage's: a stage that renumbered alone stood a round off its
            # neighbours, each waiting for a seal the other held up, and the seal's learned deadline grew
            # round after round (3 s rounds became 41 s: benchmarks/results/utilization-caps). The work
            # stays in the working weights: the next round's Δ carries it.
            log.info(
                "round %d was sealed before this stage finished it: its work goes into round %d",
                round_,
                training.base + 1,
            )
            return True
        if self.backwards == 0:
            # the routing gave us nothing this round (fewer micro-batches than workers): nothing to
            # announce; what the error feedback holds goes with the next round
            log.info("round %d: no micro-batch came this way; nothing to announce", round_)
            return True
        async with self.compute:
            messages = await asyncio.to_thread(training.end_round, round_, self.peer_id)
        payloads = self.rounds.keep(round_, messages)
        announcement = {
            "round": round_,
            "shards": {shard: sha256_hex(data) for shard, data in payloads.items()},
            "tokens": training.tokens - tokens_before,
            "steps": self.backwards,  # micro-batches this worker served: H, or paced as many as fit
            "train_s": float(round(trained_s, 3)),  # the chain's pace, for a paced round's budget
        }
        log.info(
            "round %d: stage %d trained %d micro-batches in %.1f s%s (%.1f s waiting for the round "
            "before): announcing shards %s",
            round_,
            self.layout.index,
            self.backwards,
            trained_s,
            f" (loss {training.worker.last_loss:.3f})" if self.layout.last else "",
            wait_s,
            sorted(payloads),
        )
        record = RoundRecord(
            round_,
            "stage",
            round(trained_s, 3),
            announcement["tokens"],
            sum(len(data) for data in payloads.values()),
            activation_bytes_sent=self.bytes_sent - sent_before,
            activation_bytes_received=self.bytes_received - received_before,
            steps=announcement["steps"],
            loss=training.worker.last_loss if self.layout.last else None,
            **training.weight_delays(since=delays_before),
            compute_s=round(self.compute_s - compute_before, 3),
            send_s=round(self.send_s - send_before, 3),
            started_at=started_at,
            train_wait_s=round(wait_s, 3),
            overlap=self.config.outer.overlap,
            second_opinions=self.links.copies,
        )
        self._report_compression(record, payloads)
        self.syncing = asyncio.create_task(self._sync(announcement, record, stop), name=f"sync-{round_}")
        if not self.config.outer.overlap:  # lockstep: the next round starts from the new θ
            return await self._settle_sync(stop)
        return True

    async def _sync(self, announcement: dict, record: RoundRecord, stop: asyncio.Event) -> bool:
        """Take part in the announced round and stand on the θ it ends with; False when stopped."""
        outcome = await self.rounds.take_part(announcement, stop, record)
        if outcome is None:
            return False
        await self._rebase((announcement["round"],) if outcome.left_out else ())
        return True

    async def _settle_sync(self, stop: asyncio.Event) -> bool:
        """Wait for the round syncing (if any) to end; False when stopped."""
        syncing, self.syncing = self.syncing, None
        if syncing is None:
            return True
        try:
            await asyncio.wait([syncing, self.failed], return_when=asyncio.FIRST_COMPLETED)
        except asyncio.CancelledError:
            syncing.cancel()
            raise
        if not syncing.done():
            syncing.cancel()
            await asyncio.gather(syncing, return_exceptions=True)
            raise ChainBroken(self.failed.result())
        return syncing.result() and not stop.is_set()

    async def _stand_on(self, round_: int, stop: asyncio.Event) -> bool:
        """Stand on θ after `round_` or later: a round we did not sync (it was sealed before we trained
        it, or we trained it from older θ) comes from the sealer (`catch_up`). False when stopped."""
        while self.training.base < round_:
            if self.global_model.params_round < round_ and not await self.rounds.catch_up(stop):
                if await sleep_or_stop(stop, 1.0):
                    return False
                continue
            await self._rebase(())
        return True

    async def _rebase(self, left_out: tuple[int, ...]) -> None:
        """Stand on the θ we hold now, between two micro-batches, settling our payloads (`left_out`: back
        into error feedback); save the local state as of it off the loop; publish the round we hold."""
        training = self.training
        contributors = self.rounds.last_contributors
        async with self.compute:  # nothing steps θ here: the apply that made it is done
            rebase = await asyncio.to_thread(training.rebase_from, self.global_model, left_out, contributors)
            state = await asyncio.to_thread(self._rebased_state, rebase)
        self.writer.submit(state)
        await self._publish()

    def _rebased_state(self, rebase: Rebase) -> dict:
        self.training.rebase(rebase)
        return self.training.local_state()  # copies, taken with the rebase: consistent

    def _report_compression(self, record: RoundRecord, payloads: dict[str, bytes]) -> None:
        """Measured ratios: our payload against dense fp32, our frames against dense bf16 activations."""
        if self.metrics is None:
            return
        if record.upload_bytes:
            dense = self.global_model.dense_bytes(payloads)
            self.metrics.set_compression("sparseloco", dense / record.upload_bytes)
        # every token crosses each of our boundaries once forward (not the last stage) and once back
        directions = (not self.layout.last) + (self.layout.index > 0)
        dense_activations = record.tokens * self.config.model.d_model * 2 * directions
        if record.activation_bytes_sent and dense_activations:
            self.metrics.set_compression("subspace", dense_activations / record.activation_bytes_sent)

    async def _next_round(self, stop: asyncio.Event) -> int | None:
        """The round to train next (None: stopped). The first stage decides: the round after the one it
        syncs (overlap), or θ after the newest seal, plus one (it catches up first if the swarm moved on).
        The others train the round the first stage's frames carry: the round after the one they sync, or
        else one they catch up to; a first stage behind them breaks the chain."""
        if self.layout.first:
            if self.syncing is not None:
                return self.last_round + 1
            if await self.rounds.catch_up(stop):
                await self._rebase(())
            return max(self.last_round + 1, self.training.base + 1)
        await self._until(self._round_requested)
        self._round_requested.clear()
        wanted = self._requested_round
        if self.syncing is not None and wanted == self.last_round + 1:
            return wanted  # trained while our last round syncs
        if not await self._settle_sync(stop):
            return None
        if wanted > self.global_model.params_round + 1 and await self.rounds.catch_up(stop):
            await self._rebase(())
        held = self.global_model.params_round
        if self.config.outer.overlap and held - 1 <= wanted <= held:
            # the swarm sealed the round while the first stage started it: train along (the progress goes
            # into the next round's Δ) rather than break the chain over one round
            log.info("round %d: sealed already (we hold θ after round %d); training along", wanted, held)
            return wanted
        if wanted != held + 1:
            raise ChainBroken(f"the first stage trains round {wanted}, this stage holds θ after round {held}")
        return wanted

    async def _publish(self) -> None:
        await self.presence.update(
            params_round=self.global_model.params_round,
            layer_digests=self.global_model.digests(),
            tokens=self.training.tokens if self.training is not None else None,
            outer_step=max(self.global_model.params_round, 0),
            utilization=self.rounds.utilization,
            floor_s=self._floor_s(),
        )

    def _floor_s(self) -> float | None:
        """Paced, first stage: the seconds the chain's floor of micro-batches takes at its measured pace,
        the drain included (in its record: the budget may rise to let the chain in)."""
        o = self.config.outer
        if not o.paced or not self.layout.first:
            return None
        return floor_seconds(o.step_floor, self.mb_s, MAX_ROUND_S, self.drain_s)

    async def _until(self, event: asyncio.Event) -> None:
        """Wait for `event`, or raise ChainBroken if the chain failed meanwhile."""
        waiter = asyncio.create_task(event.wait())
        await asyncio.wait([waiter, self.failed], return_when=asyncio.FIRST_COMPLETED)
        if not waiter.done():
            waiter.cancel()
            raise ChainBroken(self.failed.result())

    def _drift_of(self, round_: int) -> int | None:
        """The θ round whose embedding gives `round_`'s T_fix', as the first stage named it."""
        if not self.training.needs_drift:
            return None
        if self.drift_base is None or self.drift_base[0] != round_:
            raise ChainBroken(f"the previous stage named no θ round for round {round_}'s T_fix'")
        return self.drift_base[1]

    async def _hold_embedding_after(self, base: int | None, stop: asyncio.Event) -> bool:
        """Make sure we hold θ's embedding after round `base`. A stage stands a round or two from the first
        one at most (every stage compressed its last round on θ of the round before), so this is at once,
        but after a catch-up the first stage may be ahead: then we stand on that θ first (our round
        syncing settles first). A θ neither held nor brought by our sync breaks the chain. False when
        stopped."""
        training = self.training
        if base is None or base in training.embeddings:
            return True
        if base < training.base:
            raise ChainBroken(f"the first stage builds T_fix' from θ after round {base}, long gone here")
        # Never a wait on the first stage's word alone: θ we hold, or the θ the round we sync brings (a
        # wait this stage makes anyway before it compresses its next round), and nothing newer.
        reachable = self.last_round if self.syncing is not None else self.global_model.params_round
        if base > reachable:
            raise ChainBroken(
                f"the first stage builds T_fix' from θ after round {base}; no seal this stage holds or "
                f"awaits makes it (at most θ after round {reachable})"
            )
        log.info("the first stage stands on θ after round %d, ahead of us: catching up first", base)
        return await self._settle_sync(stop) and await self._stand_on(base, stop)

    async def _feed(self, round_: int) -> None:
        """First stage: name the θ round of the round's T_fix' to every worker downstream, then start H
        micro-batches (paced: as many as end within the round's budget, the last round's drain counted,
        between the floor and the cap), never more than the stage's window unanswered."""
        training = self.training
        o = self.config.outer
        if training.drift_base is not None:
            for link in self.links.live(self.links.downs):
                await self.links.send(link, encode_drift(round_, training.drift_base))
        began = last = time.monotonic()
        fed = 0
        while another_step(
            fed,
            time.monotonic() - began + self.drain_s,
            self.mb_s,
            round_budget_left(self.rounds.round_budget_s, began, round_, self.rounds.seal_seen),
            o.step_floor,
            o.step_cap,
            o.inner_steps,
        ):
            await self._enter_window()
            async with self.compute:
                mb, batch = training.next_batch()
                frame = await self._computed(training.forward, mb, batch)
            await self.links.route(mb, self._act_frame(round_, mb, frame))
            fed += 1
            now = time.monotonic()
            took, last = now - last, now
            self.mb_s = took if self.mb_s is None else 0.8 * self.mb_s + 0.2 * took
            if not o.paced and fed == o.inner_steps:
                break
        self.target = fed
        self._check_done()

    async def _read_activations(self, link: Link) -> None:
        """Stages after the first, one link from a worker upstream: forward what arrives and route it on;
        the last stage also runs the backward at once and answers on the same link."""
        training = self.training
        limits = training.limits
        kinds: tuple[FrameKind, ...] = ("act", "end", "drift") if limits.d_model else ("act", "end")
        while True:
            data = await self.links.receive(link, frame_size_limit(limits, kinds))
            try:
                frame = decode_frame(data, limits, expect_kind=kinds)
            except WireError as exc:
                raise LinkFailed(
                    f"invalid activation frame from the previous stage: {exc}", blame=True
                ) from None
            if frame.kind == "drift":
                await self._take_drift(link, frame.round, frame.base)
                continue
            await self._wait_for_round(frame.round, fresh=frame.kind == "act")
            if frame.kind == "end":
                self._take_round_end(link, frame.round, frame.mb)
                continue
            off = self._norm_off(link, "act", frame.tensor)
            if off is not None:
                raise LinkFailed(f"activation frame from the previous stage: {off}", True)
            link.received += 1
            again = self._sent_again(link, frame.mb)
            if again:
                continue
            self.received += 1
            if not self.layout.last:  # the last stage answers at once: it never holds a micro-batch
                await self._enter_window()
            incoming = Frame(frame.mb, frame.tensor, frame.tokens, frame.targets)
            async with self.compute:
                out = await self._computed(training.forward, frame.mb, incoming)
                if self.layout.last:
                    grad = await self._computed(training.backward, frame.mb)
            if self.layout.last:  # counted first: the next round's frames may follow this gradient at once
                self._count_backward()
                await self.links.send(link, self._grad_frame(frame.round, frame.mb, grad))
            else:
                self.links.came_from[frame.mb] = link
                await self.links.route(frame.mb, self._act_frame(frame.round, frame.mb, out))

    def _sent_again(self, link: Link, mb: int) -> bool:
        """Micro-batch `mb` arrived on `link` while in flight here: True when the previous stage sent it
        again because the worker it first came through left (its gradient then goes back this way);
        LinkFailed when it is a duplicate no honest stage sends."""
        if not self.training.in_flight(mb):
            return False
        first = self.links.came_from.get(mb)
        if first is not None and first.lost and first is not link:
            self.links.came_from[mb] = link
            return True
        raise LinkFailed(f"micro-batch {mb} arrived twice", blame=True)

    def _norm_off(self, link: Link, kind: str, tensor: torch.Tensor) -> str | None:
        """A pool's statistical check: why a frame is far off what the stage's other workers send (None:
        it is not). An activation that is off is a lie; a gradient that is off is asked of another worker
        first (an honest worker's gradients can jump as far early in training, and the other's answer for
        the same micro-batch then jumps with it)."""
        links = self.links.ups if kind == "act" else self.links.downs
        if len(self.links.live(links)) < 2:
            return None
        return self.norms[kind].judge(link.peer, float(tensor.float().norm()))

    async def _take_drift(self, link: Link, round_: int, base: int) -> None:
        """Keep the θ round of the T_fix' of the round about to start and pass it on to every worker
        downstream (as we encode it: the bytes we forward are never the sender's). The same word from a
        second worker of the previous stage's pool is taken once. Overlapped, a round the swarm sealed
        without us while the first stage started it is trained along (`_next_round`), so its drift frame
        is taken too. The first stage's word is checked (`drift_refusal`): a refusal loses the link."""
        if self.drift_base == (round_, base) and link.drift_round < round_:
            link.drift_round = round_
            return
        held = self.global_model.params_round
        oldest = held - 1 if self.config.outer.overlap else held + 1
        named = self.drift_base[0] if self.drift_base is not None else -1
        refusal = drift_refusal(round_, base, oldest, max(named, self.last_round))
        if refusal is not None:
            raise LinkFailed(f"refused the previous stage's drift frame: {refusal}")
        self.drift_base = (round_, base)
        link.drift_round = round_
        for down in self.links.live(self.links.downs):
            await self.links.send(down, encode_drift(round_, base))

    def _take_round_end(self, link: Link, round_: int, count: int) -> None:
        """A worker upstream says it sent us `count` micro-batches of the open round, all of which arrived
        before this frame (one stream, in order)."""
        if round_ != self.round_ or link.ended:
            raise LinkFailed(f"a round-end frame for round {round_}, which is not the round open here")
        if count != link.received:
            raise LinkFailed(
                f"round {round_} ends at {count} micro-batches on this link; {link.received} arrived"
            )
        link.ended = True
        self._check_done()

    async def _read_gradients(self, link: Link) -> None:
        """Stages before the last, one link to a worker downstream: take each gradient that returns
        (checked at once), back-propagated in the order its micro-batches went down (`_step_in_order`)."""
        training = self.training
        limits = training.limits
        while True:
            data = await self.links.receive(link, limits.max_bytes)
            try:
                frame = decode_frame(data, limits, expect_kind="grad", expect_round=self.round_)
            except WireError as exc:
                raise LinkFailed(f"invalid gradient frame from the next stage: {exc}", blame=True) from None
            if self.links.is_copy(frame.mb, link):  # a second opinion: compared, never stepped on
                await self._second_opinion(link, frame.mb, frame)
            else:
                await self._take_gradient(link, frame)

    async def _take_gradient(self, link: Link, frame: DecodedFrame) -> None:
        """The gradient for a micro-batch routed to `link` is back: held, then stepped on in order (a
        gradient far off the pool's norms waits for another worker's answer first)."""
        training, mb = self.training, frame.mb
        if not training.in_flight(mb) or not self.links.expects(mb, link) or mb in self.held_grads:
            raise LinkFailed(f"a gradient for micro-batch {mb}, which is not in flight", blame=True)
        off = self._norm_off(link, "grad", frame.tensor)
        sent = self.links.answered(mb)
        self.held_grads[mb] = (link, frame, sent)
        if off is not None:  # held until another worker answers the same micro-batch
            if not await self.links.ask_about(mb, sent.frame, link.peer):
                raise LinkFailed(f"gradient frame from the next stage: {off}", True)
            self.suspects[mb] = off
        if mb in self.links.audits:
            await self._second_opinion(link, mb, frame)
        await self._step_in_order()

    async def _second_opinion(self, link: Link, mb: int, frame: DecodedFrame) -> None:
        """A gradient for `mb`, asked of more than one worker, is back on `link`; judged once all answered
        (`gradients_agree`). A worker whose gradient was off the pool's norms (a suspect) and off another's
        answer for the same micro-batch lies; else two that disagree ask a third, and of three the one
        that disagrees with both others lies. A liar's link is lost (blamed), and a gradient of its not
        stepped on yet is replaced by an honest one. Two workers alone cannot tell which of them lies: the
        chain breaks, blaming nobody (docs/chains.md, "Second opinions")."""
        links = self.links
        audit = links.audits[mb]
        audit.grads[link.peer] = frame.tensor
        if audit.waiting:
            return
        del links.audits[mb]
        suspect = self.suspects.pop(mb, None)
        held = self.held_grads.get(mb)
        if audit.void or len(audit.grads) < 2:  # no other answer to weigh it against
            if suspect is not None and held is not None:
                await self._suspect_without_opinion(mb, held, suspect)
            await self._step_in_order()
            self._check_done()
            return
        peers = list(audit.grads)
        agree = {}
        for i, a in enumerate(peers):
            for b in peers[i + 1 :]:
                x, y = audit.grads[a], audit.grads[b]
                cosine, ratio = await asyncio.to_thread(lambda x=x, y=y: (agreement(x, y), norm_ratio(x, y)))
                agree[frozenset((a, b))] = gradients_agree(cosine, ratio)
                log.debug(
                    "micro-batch %d: %s and %s, cosine %.2f, norms %.1f× apart",
                    mb,
                    a[-8:],
                    b[-8:],
                    cosine,
                    ratio,
                )
        liar = None
        if suspect is not None and held is not None:
            if not all(ok for pair, ok in agree.items() if held[0].peer in pair):
                liar, why = held[0].peer, suspect
            else:  # another worker's answer jumped with it: honest, and its norm is the pool's now
                log.info("micro-batch %d: a gradient far off the pool's norms agrees with another's", mb)
                self.norms["grad"].learn(held[0].peer, float(held[1].tensor.float().norm()))
        elif len(peers) == 2:
            if not next(iter(agree.values())):
                links.audits[mb] = audit
                if await links.ask_another(mb):
                    return
                links.audits.pop(mb, None)
                raise ChainBroken(
                    f"two workers of the next stage disagree on micro-batch {mb}'s gradient: one of them "
                    "lies, and with two this stage cannot tell which"
                )
        else:
            liar = odd_one_out(agree)
            why = f"micro-batch {mb}'s gradient disagrees with the two other workers'"
            if liar is None and not all(agree.values()):
                log.warning(
                    "chain %s: three workers' gradients for micro-batch %d agree on no majority",
                    self.layout.chain,
                    mb,
                )
        if liar is not None:
            if held is not None and held[0].peer == liar:  # not stepped on yet: an honest answer instead
                honest = next(p for p in peers if p != liar)
                self.held_grads[mb] = (
                    links.downs[honest],
                    replace(held[1], tensor=audit.grads[honest]),
                    held[2],
                )
            await links.lose(links.downs[liar], f"gradient frame from the next stage: {why}", blame=True)
        await self._step_in_order()
        self._check_done()

    async def _suspect_without_opinion(self, mb: int, held: tuple, suspect: str) -> None:
        """A suspect gradient no other worker could answer for: a lie if its worker is still here (what the
        norm check alone said before second opinions); if it left, its micro-batch goes to another."""
        link, _, sent = held
        del self.held_grads[mb]
        if not link.lost:
            await self.links.lose(link, f"gradient frame from the next stage: {suspect}", blame=True)
        await self.links.route(mb, sent.frame)

    async def _without_opinion(self, mb: int) -> None:
        """Suspect `mb`'s second opinion was lost with the worker asked."""
        suspect, held = self.suspects.pop(mb, None), self.held_grads.get(mb)
        if suspect is not None and held is not None:
            await self._suspect_without_opinion(mb, held, suspect)
            await self._step_in_order()

    async def _step_in_order(self) -> None:
        """Back-propagate the held gradients while the oldest micro-batch in flight has one. Workers of a
        pool answer out of order; stepping in forward order keeps each micro-batch's weight delay within
        P−1−s steps, as in 1F1B (a younger answer waits for the older one, never the reverse). Before a
        pool of W, W times the window is in flight and a step takes W gradients: its room comes back
        with the step, so the delay in steps stays P−1−s."""
        training = self.training
        while True:
            oldest = next(iter(training.worker.in_flight), None)
            if oldest is None or oldest not in self.held_grads or oldest in self.suspects:
                return
            link, frame, sent = self.held_grads.pop(oldest)
            async with self.compute:
                applied = training.worker.applied  # under the lock: only steps this backward takes
                try:
                    grad = await self._computed(training.backward, oldest, frame.tensor)
                except UpdateRefused as exc:  # refused before any step: our state is as it was
                    refused = f"a gradient from the next stage was refused: {exc}"
                else:
                    refused = None
            if refused is not None:  # its micro-batch goes to another worker of the pool
                await self.links.lose(link, refused, blame=True)
                await self.links.route(oldest, sent.frame)
                continue
            if self.window is not None:  # room once a step took it in (a group's last gradient)
                for _ in range(training.worker.applied - applied):
                    self.window.release()
            up = self.links.came_from.pop(oldest, None)
            self._count_backward()  # first: the next round's frames may follow this gradient at once
            if grad is not None and up is not None:
                await self.links.send(up, self._grad_frame(frame.round, oldest, grad))

    async def _enter_window(self) -> None:
        """Wait for room in this stage's in-flight window (a gradient coming back makes room)."""
        assert self.window is not None
        acquire = asyncio.create_task(self.window.acquire())
        await asyncio.wait([acquire, self.failed], return_when=asyncio.FIRST_COMPLETED)
        if not acquire.done():
            acquire.cancel()
            raise ChainBroken(self.failed.result())

    def _count_backward(self) -> None:
        self.backwards += 1
        self._check_done()

    def _check_done(self) -> None:
        """The open round is done here once all its micro-batches are answered: the first stage's, once it
        stopped feeding; a later stage's, once every live link upstream ended the round."""
        if not self.round_open.is_set():
            return
        if self.links.audits:  # a second opinion still out: its gradient must not meet the next round
            return
        if self.layout.first:
            done = self.target is not None and self.backwards >= self.target
        else:
            ended = all(link.ended for link in self.links.live(self.links.ups))
            done = ended and self.backwards >= self.received
        if done:
            self.round_open.clear()  # at once: a frame of the next round asks for it, it is no stray
            self.round_done.set()

    async def _wait_for_round(self, round_: int, fresh: bool = True) -> None:
        """Hold a frame until its round is open here: the first frame of a round asks the round loop to
        open it (after the seal of the previous one is applied). `fresh`: an act frame (counted against
        the cap)."""
        if self.round_open.is_set():
            if self.round_ != round_:
                raise LinkFailed(f"a frame of round {round_} arrived while training round {self.round_}")
            cap = self.config.outer.step_cap
            if fresh and self.received >= cap:
                raise LinkFailed(f"more than {cap} micro-batches in round {self.round_}", blame=True)
            return
        if round_ <= self.last_round:
            raise LinkFailed(f"a frame of round {round_}, which ended here")
        self._requested_round = round_
        self._round_requested.set()
        await self._until(self.round_open)
        if self.round_ != round_:
            raise LinkFailed(f"a frame of round {round_} arrived while training round {self.round_}")

    async def _computed(self, step: Callable[..., Any], *args: Any) -> Any:
        """`step(*args)` in a worker thread, its time counted in `compute_s`."""
        started = time.perf_counter()
        try:
            return await asyncio.to_thread(step, *args)
        finally:
            self.compute_s += time.perf_counter() - started

    def _act_frame(self, round_: int, mb: int, out: Frame | torch.Tensor) -> bytes:
        """The activation frame of micro-batch `mb`, as our strategy sends it downstream."""
        assert isinstance(out, Frame)
        tensor = self.faults.sent_activations(out.tensor)
        return encode_frame("act", round_, mb, tensor, out.tokens, out.targets)

    def _grad_frame(self, round_: int, mb: int, grad: torch.Tensor) -> bytes:
        """The gradient frame of micro-batch `mb`, as our strategy sends it upstream."""
        return encode_frame("grad", round_, mb, self.faults.sent_gradients(grad))

    def _up_mbps(self) -> float:
        """Our upload rate as last measured (our record), else the least a stage may have (the config)."""
        measured = self.presence.record.get("up_mbps")
        floor = self.config.network.stage_min_up_mbps
        return float(measured) if isinstance(measured, int | float) and measured > 0 else floor
