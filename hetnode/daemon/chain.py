"""The stage role over the network: one member of a chain running the asynchronous 1F1B pipeline over
hivemind P2P streams, then taking part in the sealed round with its own layers (docs/chains.md, "Asynchronous
1F1B with weight stashing", §3.5).

Each boundary between stages s and s+1 is one duplex stream that stage s opens: activation frames
(subspace coefficients in bf16 with token ids and targets) go down, activation-gradient frames come back
up. The first stage reads the chain's data slot; every stage but the last keeps at most `stage_window`
micro-batches unanswered (P − s by default: the 1F1B schedule, whose weight delay is τ_s = P−1−s) and
holds a new one back until a gradient came back. Weight stashing in `StageWorker` makes the schedule
asynchronous without changing the math; each round's log records the weight delays the stage saw.

A round is H micro-batches: the first stage stops feeding after H, every stage finishes its H backward
passes (the drain), encodes Δ of its own shards and announces. In lockstep it then waits for the seal and
applies it before the next round; with `outer.overlap` the round syncs in a task of its own while the
first stage feeds the next round's micro-batches and later stages accept them (docs/sync.md "Overlap").
Each stage stands on the new θ when its own apply is done, between two micro-batches, keeping its progress;
the round's T_fix' stays the one the first stage named (its drift frame: a θ round, whose embedding every
stage holds) for every stage until the next round. Frames
carry their round; at most one round is unapplied: a round is compressed only once θ of the round before
is stood on (else the stage waits, and that wait is what utilisation counts).

Anything wrong with a neighbour (a frame that fails validation, a gradient the stage refuses to step on,
a stream that breaks, a member whose record expired) breaks the chain: in-flight work is dropped, θ is
untouched, and the peer daemon says so in its record: at the next boundary the chain goes on with a spare
in the empty stage, or dissolves (docs/chains.md, "When a member leaves").
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from hetnode.config import Config
from hetnode.daemon.faults.strategy import HONEST, Faults
from hetnode.daemon.participant import RoundParticipant
from hetnode.daemon.rounds import write_state
from hetnode.daemon.stage_training import StageTraining, drift_refusal
from hetnode.data.epochs import training_dataset
from hetnode.errors import HetnodeError, UpdateRefused, WireError
from hetnode.net.node import SwarmNode
from hetnode.net.records import MAX_ROUND_S
from hetnode.net.streams import OpenStream, PeerRequestError, read_frame, write_frame
from hetnode.planning.rounds import another_step, floor_seconds
from hetnode.protocol.payload_opener import payload_opener
from hetnode.protocol.view import PeerDirectory, SwarmView
from hetnode.replica.global_model import GlobalModel, sha256_hex
from hetnode.service.lifecycle import sleep_or_stop
from hetnode.service.metrics import PeerMetrics
from hetnode.service.presence import Presence
from hetnode.service.round_log import RoundRecord
from hetnode.service.state_writer import LatestStateWriter
from hetnode.training.local_rounds import Rebase
from hetnode.training.schedule import stage_window
from hetnode.training.stage_round import stage_part
from hetnode.training.stage_worker import Frame
from hetnode.wire.activation_frame import (
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

CONNECT_S = 30.0  # neighbours must be connected this soon after the chain went live
WRITE_SLACK = 4.0  # a frame write may take this many times its transfer at our measured upload rate
MIN_WRITE_TIMEOUT_S = 30.0  # plus this: the first bytes wait for a window, a round trip, a busy neighbour


def frame_write_timeout_s(nbytes: int, up_mbps: float) -> float:
    """How long one frame write may take before the neighbour counts as stalled: the transfer at our
    measured upload rate, `WRITE_SLACK` times, plus `MIN_WRITE_TIMEOUT_S`. A fixed timeout either breaks a
    slow honest link on a large frame or waits minutes for a dead neighbour on a fast one."""
    transfer_s = nbytes * 8 / (max(up_mbps, 1e-3) * 1e6)
    return MIN_WRITE_TIMEOUT_S + WRITE_SLACK * transfer_s


class ChainBroken(HetnodeError):
    """This chain cannot go on (a neighbour left, or sent something invalid)."""

    def __init__(self, message: str, blame: str | None = None) -> None:
        super().__init__(message)
        self.blame = blame  # the neighbour whose frame failed our checks (it cannot be an honest one's)


@dataclass(frozen=True)
class ChainLayout:
    chain: str
    index: int  # our stage
    members: tuple[str, ...]  # peer id of each stage, in stage order
    splits: tuple[range, ...]  # layers of each stage
    lineage: str = ""  # the name the chain was founded under: whose data slot it trains on

    @classmethod
    def from_view(cls, view: SwarmView, chain: str, peer_id: str) -> ChainLayout | None:
        """The live chain `chain` as the records say, or None when it is not live or we are not in it."""
        status = next((c for c in view.chains() if c.chain == chain and c.live), None)
        if status is None or peer_id not in status.stages:
            return None
        members = tuple(p for p in status.stages if p is not None)
        splits = []
        for member in members:
            first, last = view.peers[member]["layers"]
            splits.append(range(first, last + 1))
        return cls(chain, members.index(peer_id), members, tuple(splits), status.lineage)

    @property
    def first(self) -> bool:
        return self.index == 0

    @property
    def last(self) -> bool:
        return self.index == len(self.members) - 1

    @property
    def upstream(self) -> str | None:
        return None if self.first else self.members[self.index - 1]

    @property
    def downstream(self) -> str | None:
        return None if self.last else self.members[self.index + 1]


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
    ) -> None:
        """`data_dir` gets the round log; `directory`: the daemon's shared reads of the peer records;
        `faults`: tests only, a stage whose frames are hostile (`hetnode.daemon.faults`)."""
        self.config = config
        self.node = node
        self.presence = presence
        self.layout = layout
        self.data_dir = data_dir
        self.device = device
        self.metrics = metrics
        self.faults = faults
        self.state_path = data_dir / f"stage-state-{node.run}.pt"  # for restarts, as an anchor keeps one
        self.bytes_sent = 0  # activation and gradient frames, since the chain started
        self.bytes_received = 0
        self.compute_s = 0.0  # in forward and backward passes, since the chain started
        self.send_s = 0.0  # writing frames to neighbours, since the chain started
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
        self.backwards = 0
        self.received = 0  # act frames of the open round (stages after the first)
        # micro-batches of the open round: H, or under paced rounds what the first stage says at its end
        self.target: int | None = None
        self.mb_s: float | None = None  # paced, first stage: the time between two micro-batches fed
        self.drain_s = 0.0  # paced, first stage: from the last micro-batch fed to the round's end, last round
        self.window: asyncio.Semaphore | None = None
        self.failed: asyncio.Future[str] | None = None
        self.blamed: str | None = None  # the neighbour whose frame broke the chain (`ChainBroken.blame`)
        self.upstream: OpenStream | None = None
        self.downstream: OpenStream | None = None
        self._upstream_ready: asyncio.Event = asyncio.Event()
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
        try:
            await self.rounds.catch_up(stop)
            await self._rebase(())
            await self._connect(stop)
            tasks = [asyncio.create_task(self._watch_members(stop), name="chain-watch")]
            if not layout.last:
                tasks.append(asyncio.create_task(self._read_gradients(), name="chain-grads"))
            if not layout.first:
                tasks.append(asyncio.create_task(self._read_activations(), name="chain-acts"))
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
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            for stream in (self.upstream, self.downstream):
                if stream is not None:
                    stream.close()
            if self.training is not None:
                self.training.worker.drop_in_flight()
            await asyncio.to_thread(self.writer.close)
        reason = self.failed.result() if self.failed.done() else "stopped"
        if reason != "stopped":
            log.warning("chain %s: %s; in-flight work dropped, θ untouched", layout.chain, reason)
        return reason

    def _fail(self, reason: str) -> None:
        if self.failed is not None and not self.failed.done():
            self.failed.set_result(reason)

    def _broken(self, exc: ChainBroken) -> None:
        """The chain ends; the first neighbour caught sending what no honest stage sends is kept in
        `blamed` (the peer daemon says so in its record: the chain goes on without it)."""
        if exc.blame is not None and self.blamed is None and (self.failed is None or not self.failed.done()):
            self.blamed = exc.blame
            log.warning("chain %s: %s sent what no honest stage sends: %s", self.layout.chain, exc.blame, exc)
        self._fail(str(exc))

    def _task_ended(self, task: asyncio.Task) -> None:
        if task.cancelled():
            return
        exc = task.exception()
        if isinstance(exc, ChainBroken):
            self._broken(exc)
        elif exc is not None:  # a task that returns was stopped
            self._fail(str(exc))

    async def _connect(self, stop: asyncio.Event) -> None:
        """Open our stream downstream and wait for the one from upstream."""
        deadline = time.monotonic() + CONNECT_S
        while self.layout.downstream is not None and self.downstream is None:
            try:
                stream = await self.node.open_stage_stream(self.layout.downstream)
            except PeerRequestError as exc:
                problem = str(exc)
            else:
                try:  # the next stage accepts with an empty frame once its own chain loop runs
                    await read_frame(stream.reader, 0, timeout=5.0)
                    self.downstream = stream
                    break
                except (TimeoutError, asyncio.IncompleteReadError, ConnectionError, WireError) as exc:
                    stream.close()
                    problem = f"not accepted yet ({type(exc).__name__})"
            if time.monotonic() > deadline:
                raise ChainBroken(f"cannot reach the next stage: {problem}")
            if await sleep_or_stop(stop, 0.5):
                return
        while self.layout.upstream is not None and not self._upstream_ready.is_set():
            if time.monotonic() > deadline:
                raise ChainBroken("the previous stage did not connect")
            if await sleep_or_stop(stop, 0.1):  # a stop signal must not wait out CONNECT_S
                return
        log.info(
            "chain %s: stage %d of %d connected (layers %d..%d)",
            self.layout.chain,
            self.layout.index,
            len(self.layout.members),
            self.layout.splits[self.layout.index].start,
            self.layout.splits[self.layout.index].stop - 1,
        )

    async def _accept_upstream(
        self, peer: str, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        if peer != self.layout.upstream or self.upstream is not None:
            log.warning(
                "chain %s: refusing a stream from %s (not our previous stage)", self.layout.chain, peer
            )
            return
        await write_frame(writer, b"", 5.0)  # accepted
        self.upstream = OpenStream(peer, reader, writer)
        self._upstream_ready.set()
        await self._closing.wait()  # the stream lives as long as the chain

    async def _watch_members(self, stop: asyncio.Event) -> None:
        """Break the chain when the records say it is not live any more (a member vanished)."""
        while not await sleep_or_stop(stop, self.config.network.heartbeat_s):
            view = await self.rounds.view.get()
            if not view.chain_is_live(self.layout.chain):
                raise ChainBroken("the records say the chain is not live (a member left or says it broke)")

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
        self.target = None if self.config.outer.paced else self.config.outer.inner_steps
        self.round_done.clear()
        self.window = asyncio.Semaphore(
            stage_window(len(self.layout.members), self.layout.index, self.config.pipeline.max_in_flight)
        )
        delays_before = len(training.worker.staleness)
        self.round_ = round_
        self.last_round = round_
        self.round_open.set()
        if self.layout.first:
            await self._feed(round_)
        fed = time.monotonic()
        await self._until(self.round_done)
        self.drain_s = time.monotonic() - fed
        trained_s = time.monotonic() - started
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
        async with self.compute:
            messages = await asyncio.to_thread(training.end_round, round_, self.peer_id)
        payloads = self.rounds.keep(round_, messages)
        announcement = {
            "round": round_,
            "shards": {shard: sha256_hex(data) for shard, data in payloads.items()},
            "tokens": training.tokens - tokens_before,
            "steps": self.target,  # micro-batches: H, or under paced rounds as many as fit
            "train_s": float(round(trained_s, 3)),  # the chain's pace, for a paced round's budget
        }
        log.info(
            "round %d: stage %d trained in %.1f s%s (%.1f s waiting for the round before): "
            "announcing shards %s",
            round_,
            self.layout.index,
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
        """First stage: name the θ round of the round's T_fix', then start H micro-batches, never more than
        the stage's window unanswered. Paced rounds: as many as end within the round's budget (the last
        round's drain counted), between the floor and the cap, then the round's end frame with the count."""
        training = self.training
        o = self.config.outer
        if training.drift_base is not None:
            await self._send(self.downstream, encode_drift(round_, training.drift_base))
        budget = self.rounds.round_budget_s
        began = last = time.monotonic()
        fed = 0
        while another_step(
            fed,
            time.monotonic() - began + self.drain_s,
            self.mb_s,
            budget,
            o.step_floor,
            o.step_cap,
            o.inner_steps,
        ):
            await self._enter_window()
            async with self.compute:
                mb, batch = training.next_batch()
                frame = await self._computed(training.forward, mb, batch)
            await self._send(self.downstream, self._act_frame(round_, mb, frame))
            fed += 1
            now = time.monotonic()
            took, last = now - last, now
            self.mb_s = took if self.mb_s is None else 0.8 * self.mb_s + 0.2 * took
            if not o.paced and fed == o.inner_steps:
                return
        if o.paced:
            await self._send(self.downstream, encode_round_end(round_, fed))
            self._round_has(fed)

    async def _read_activations(self) -> None:
        """Stages after the first: forward what arrives; the last stage also runs the backward at once."""
        training = self.training
        limits = training.limits
        kinds: tuple[FrameKind, ...] = ("act", "drift") if limits.d_model else ("act",)
        if self.config.outer.paced:
            kinds += ("end",)
        while True:
            data = await self._receive(self.upstream, frame_size_limit(limits, kinds))
            try:
                frame = decode_frame(data, limits, expect_kind=kinds)
            except WireError as exc:
                raise ChainBroken(
                    f"invalid activation frame from the previous stage: {exc}", self.layout.upstream
                ) from None
            if frame.kind == "drift":
                await self._take_drift(frame.round, frame.base)
                continue
            if frame.kind == "end":
                await self._take_round_end(frame.round, frame.mb)
                continue
            await self._wait_for_round(frame.round)
            self.received += 1
            if not self.layout.last:  # the last stage answers at once: it never holds a micro-batch
                await self._enter_window()
            incoming = Frame(frame.mb, frame.tensor, frame.tokens, frame.targets)
            async with self.compute:
                if training.in_flight(frame.mb):
                    raise ChainBroken(f"micro-batch {frame.mb} arrived twice", self.layout.upstream)
                out = await self._computed(training.forward, frame.mb, incoming)
                if self.layout.last:
                    grad = await self._computed(training.backward, frame.mb)
            if self.layout.last:  # counted first: the next round's frames may follow this gradient at once
                self._count_backward()
                await self._send(self.upstream, self._grad_frame(frame.round, frame.mb, grad))
            else:
                await self._send(self.downstream, self._act_frame(frame.round, frame.mb, out))

    async def _take_drift(self, round_: int, base: int) -> None:
        """Keep the θ round of the T_fix' of the round about to start and pass it on down the chain (as we
        encode it: the bytes we forward are never the sender's). Overlapped, a round the swarm sealed
        without us while the first stage started it is trained along (`_next_round`), so its drift frame
        is taken too. The first stage's word is checked (`drift_refusal`): a refusal breaks the chain."""
        held = self.global_model.params_round
        oldest = held - 1 if self.config.outer.overlap else held + 1
        named = self.drift_base[0] if self.drift_base is not None else -1
        refusal = drift_refusal(round_, base, oldest, max(named, self.last_round))
        if refusal is not None:
            raise ChainBroken(f"refused the previous stage's drift frame: {refusal}")
        self.drift_base = (round_, base)
        if not self.layout.last:
            await self._send(self.downstream, encode_drift(round_, base))

    async def _take_round_end(self, round_: int, count: int) -> None:
        """Paced rounds: the first stage says the open round had `count` micro-batches; every one of them
        has arrived before this frame (one stream, in order). Passed on down the chain, as we encode it."""
        o = self.config.outer
        if not self.round_open.is_set() or round_ != self.round_ or self.target is not None:
            raise ChainBroken(f"a round-end frame for round {round_}, which is not the round open here")
        if count != self.received or not o.step_floor <= count <= o.step_cap:
            raise ChainBroken(f"round {round_} ends at {count} micro-batches; {self.received} arrived")
        if not self.layout.last:
            await self._send(self.downstream, encode_round_end(round_, count))
        self._round_has(count)

    def _round_has(self, count: int) -> None:
        """The open round has `count` micro-batches: it is done once that many backward passes are."""
        self.target = count
        self._done_when_drained()

    async def _read_gradients(self) -> None:
        """Stages before the last: back-propagate each gradient that returns, pass it on upstream."""
        training = self.training
        limits = training.limits
        while True:
            data = await self._receive(self.downstream, limits.max_bytes)
            try:
                frame = decode_frame(data, limits, expect_kind="grad", expect_round=self.round_)
            except WireError as exc:
                raise ChainBroken(
                    f"invalid gradient frame from the next stage: {exc}", self.layout.downstream
                ) from None
            async with self.compute:
                if not training.in_flight(frame.mb):
                    raise ChainBroken(
                        f"a gradient for micro-batch {frame.mb}, which is not in flight",
                        self.layout.downstream,
                    )
                try:
                    grad = await self._computed(training.backward, frame.mb, frame.tensor)
                except UpdateRefused as exc:  # refused before any step: our state is as it was
                    raise ChainBroken(
                        f"a gradient from the next stage was refused: {exc}", self.layout.downstream
                    ) from None
            if self.window is not None:
                self.window.release()
            self._count_backward()  # first: the next round's frames may follow this gradient at once
            if grad is not None:
                await self._send(self.upstream, self._grad_frame(frame.round, frame.mb, grad))

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
        self._done_when_drained()

    def _done_when_drained(self) -> None:
        if self.target is not None and self.backwards >= self.target:
            self.round_open.clear()  # at once: a frame of the next round asks for it, it is no stray
            self.round_done.set()

    async def _wait_for_round(self, round_: int) -> None:
        """Hold a frame until its round is open here: the first frame of a round asks the round loop to
        open it (after the seal of the previous one is applied)."""
        if self.round_open.is_set():
            if self.round_ != round_:
                raise ChainBroken(f"a frame of round {round_} arrived while training round {self.round_}")
            most = self.config.outer.step_cap if self.target is None else self.target
            if self.received >= most:
                raise ChainBroken(f"more than {most} micro-batches in round {self.round_}")
            return
        self._requested_round = round_
        self._round_requested.set()
        await self._until(self.round_open)
        if self.round_ != round_:
            raise ChainBroken(f"a frame of round {round_} arrived while training round {self.round_}")

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

    async def _send(self, stream: OpenStream | None, data: bytes) -> None:
        assert stream is not None
        started = time.perf_counter()
        try:
            await write_frame(stream.writer, data, frame_write_timeout_s(len(data), self._up_mbps()))
            self.bytes_sent += len(data)
            self.send_s += time.perf_counter() - started
        except (TimeoutError, ConnectionError, OSError) as exc:
            raise ChainBroken(f"stream to {stream.peer[-8:]} broke ({type(exc).__name__})") from None

    def _up_mbps(self) -> float:
        """Our upload rate as last measured (our record), else the least a stage may have (the config)."""
        measured = self.presence.record.get("up_mbps")
        floor = self.config.network.stage_min_up_mbps
        return float(measured) if isinstance(measured, int | float) and measured > 0 else floor

    async def _receive(self, stream: OpenStream | None, max_bytes: int) -> bytes:
        assert stream is not None
        try:
            # no timeout: between rounds a neighbour is silent while the seal is pending; a dead one is
            # noticed by the stream closing or by `_watch_members`
            data = await read_frame(stream.reader, max_bytes, timeout=None)
            self.bytes_received += len(data)
            return data
        except (asyncio.IncompleteReadError, ConnectionError, OSError) as exc:
            raise ChainBroken(f"stream from {stream.peer[-8:]} ended ({type(exc).__name__})") from None
        except WireError as exc:
            raise ChainBroken(f"bad frame from {stream.peer[-8:]}: {exc}") from None
