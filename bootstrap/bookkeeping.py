"""The coordinator's bookkeeping beside the seal, never in front of it: the verifier's loss-delta scores,
credit in the ledger, evaluation, a text sample and every K rounds a checkpoint, in one worker.

The keeper (`bootstrap/round_keeper.py`) decides round t, commits it to θ, writes the round's seal line (with
its digests), stores the seal and publishes the digests; then it hands the round to this worker and goes back
to collecting round t+1. The worker (an asyncio task whose heavy part runs in a thread) works on a model of
its own, the evaluator's, whose weights are its own copy of θ: it scores round t on that copy while it still
holds θ^{t-1}, steps it by the same checked aggregate (`outer_sgd_step`, bit for bit the coordinator's step),
credits the verified contributions, evaluates, samples and checkpoints θ^t from it, and appends the round's
evaluated line to the history (`hetnode/wire/round_history.py`). Memory: one copy of θ beyond the
coordinator's own (the evaluator's model, which it always had), plus the step of each round queued.

Evaluation and its sample come every `train.eval_every_rounds` (K) rounds: on the rounds that are multiples
of K, or when the worker skipped that one, the next round it takes in full. Scoring and credit stay every
round. With `--device cuda` the forwards (scoring, evaluation, samples) run on a copy of the model on the GPU
(`bootstrap/device_forwards.py`); the copy of θ that steps, is checked against the seal's digests and is
checkpointed stays on CPU in fp32, so digests and checkpoints do not depend on the device.

Behind: at most MAX_PENDING rounds wait. When it falls further behind, the keeper hands over a snapshot of
θ^{t-1} with round t (`needs_base`) and the older rounds waiting are superseded; of the rounds it takes at
once, the newest is scored and evaluated and the older ones are only stepped and credited on the scores
known so far (`skipped` in their evaluated line, as a round the verifier's rotating sample leaves out).
`hetnode_bookkeeping_lag_rounds` says how many sealed rounds it has not finished,
`hetnode_bookkeeping_skipped_rounds_total` how many it skipped. A failure of one phase (scoring,
evaluation, sampling, the ledger, a checkpoint) is logged and costs that phase of that round only.

A checkpoint is written from the worker's copy, which only the worker's thread changes, and only when its
layer digests equal those the seal published for that round: it never tears against the next commit. On a
clean stop the worker drops the rounds waiting (credited on the scores known, `skipped`) and ends its
current phase; the keeper then checkpoints its own θ, the newest.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from bootstrap.checkpoint_store import keep_tokenizer, store_params
from bootstrap.device_forwards import batches_on, forward_model
from bootstrap.ledger import Contribution, Ledger, Verdict
from bootstrap.samples import RoundSampler
from bootstrap.swarm_metrics import SwarmMetrics
from bootstrap.verifier import Replica, Verifier
from hetnode.algo.aggregate import outer_sgd_step
from hetnode.config import Config
from hetnode.data.dataset import TokenDataset
from hetnode.errors import CheckpointError
from hetnode.model.decoder import build_model
from hetnode.model.shards import layer_digests
from hetnode.replica.global_model import PreparedRound, base_fixed_embedding
from hetnode.training.precision import autocast_for
from hetnode.wire.round_history import EVALUATED
from hetnode.wire.sync_payload import DecodedPayload

log = logging.getLogger(__name__)

MAX_PENDING = 1  # rounds with a step waiting beside the one in hand; beyond, a snapshot supersedes them
STOP_WAIT_S = 60.0  # a clean stop waits this long for the phase in hand (a round's scoring, one eval batch)


class Stopped(Exception):
    """The coordinator is stopping: the phase in hand is left."""


@dataclass
class RoundWork:
    """One round for the worker: a sealed round (`step` set) or a catch-up (`step` None, θ^t in `base`)."""

    round: int
    step: PreparedRound | None = None  # θ^{t-1} → θ^t, checked by the sealer
    base: dict[str, torch.Tensor] | None = None  # θ after `base_round`, when the worker's copy lacks it
    base_round: int | None = None
    sealed: list[str] = field(default_factory=list)  # the seal's contributors, in sealed order
    rejected: dict[str, str] = field(default_factory=dict)  # valid contributions the seal's screens left out
    scorable: list[tuple[str, list[DecodedPayload]]] = field(default_factory=list)  # what the verifier scores
    replicas: dict[str, Replica] = field(default_factory=dict)
    steps: dict[str, int] = field(default_factory=dict)  # the inner steps each scorable one claims
    credits: list[Contribution] = field(default_factory=list)  # every sealed contribution's schedule
    sealed_at: float = 0.0
    digests: dict[str, str] = field(default_factory=dict)  # θ^t's, as published
    seal_hash: str | None = None
    catch_up: bool = False  # θ^t taken from a replica: nothing to score or credit, a checkpoint at once
    superseded: bool = False  # a newer snapshot came: credited only


def snapshot(params: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A copy of θ for the worker (the keeper takes it between commits: only its sealing loop commits)."""
    return {name: tensor.clone() for name, tensor in params.items()}


def credit_rows(credits: Iterable[Contribution]) -> dict[str, dict[str, Any]]:
    """The credit a seal line keeps per contributor, so that a round sealed just before a crash can still
    be credited by the next life (`Bookkeeper.recover`)."""
    return {
        c.peer: {
            "name": c.name,
            "role": c.role,
            "tokens": c.tokens,
            "replica_tokens": c.trained,
            "steps": c.inner_steps,
            "bytes": c.bytes_sent,
        }
        for c in credits
    }


class Bookkeeper:
    """The worker. `record` is called on the event loop with each round's evaluated line (the keeper
    appends it to the history); `checkpoints` is the checkpoint folder's root; `device` where the forwards
    run (a checked `--device`: `hetnode.cli.device.resolve_device`; settable until `build`)."""

    def __init__(
        self,
        config: Config,
        ledger: Ledger,
        checkpoints: Path,
        run: str | None,
        record: Callable[[dict[str, Any]], None],
        metrics: SwarmMetrics | None = None,
        device: torch.device | str = "cpu",
    ) -> None:
        self.config = config
        self.device = torch.device(device)
        self.ledger = ledger
        self.checkpoints = checkpoints
        self.run_id = run
        self.record = record
        self.metrics = metrics
        self.verifier: Verifier | None = None
        self.sampler: RoundSampler | None = None
        self.model: torch.nn.Module | None = None  # on CPU: its weights are θ
        self.forwards: torch.nn.Module | None = None  # the model on the device (on CPU: `model` itself)
        self.theta: dict[str, torch.Tensor] = {}  # the model's weights: the worker's copy of θ
        self.held: int | None = None  # the round of θ the copy holds (None: out of step, awaiting a snapshot)
        self.checkpoint_lock = threading.Lock()  # one checkpoint writer at a time (the keeper's on stop too)
        self._pending: deque[RoundWork] = deque()
        self._wake = asyncio.Event()
        self._tail: int | None = None  # the round the copy holds once everything handed over is done
        self._lost = False  # the copy fell out of step: the next round must bring a snapshot
        self._stopping = threading.Event()
        self._in_hand = 0  # rounds handed over and not finished
        self._checkpointed = -1
        self._evaluated = -1  # the newest round whose evaluation was tried
        self._task: asyncio.Task | None = None
        self._eval_batches: list = []
        # the swarm's credited tokens so far, and whether it was told it passed train.max_epochs: the
        # replicas' own guard sees one replica's steps, not the many slots that read the corpus at once
        self._swarm_tokens = 0
        self._epochs_told = False

    # --- set-up (blocking: run it in a thread) -----------------------------------------------------

    def build(self, params: Mapping[str, torch.Tensor], round_: int) -> None:
        """The corpus, the eval batches, the worker's model holding θ = `params` (after `round_`), its
        copy on the device, the sampler and, with `outer.verify`, the verifier (both on that copy)."""
        c = self.config
        self.dataset = TokenDataset.build(c.data, c.model.vocab_size, c.run.seed)
        try:  # served with the checkpoints: an export over HTTP must never rebuild it from a data config
            keep_tokenizer(self.checkpoints, self.dataset.tokenizer)
        except (OSError, CheckpointError) as exc:  # a view, like the page: never in the rounds' way
            log.warning(
                "cannot keep the run's tokenizer beside the checkpoints (%s): exports need --tokenizer", exc
            )
        model = build_model(c.model, seed=c.run.seed)
        model.fixed_embedding = base_fixed_embedding(c)  # the architecture anchors train
        model.requires_grad_(False)
        model.eval()
        self.model = model
        self.theta = {name: p.detach() for name, p in model.named_parameters()}
        self._load(params, round_)
        self._tail = self._checkpointed = self._evaluated = round_
        try:
            self._swarm_tokens = self.ledger.totals().tokens
        except Exception:  # a view: counted from this round on
            log.exception("cannot read the ledger's totals: the swarm's passes over the data count from here")
        self.forwards = forward_model(model, self.device)
        self._eval_batches = batches_on(self.dataset.eval_batches(c.train.eval_batches), self.device)
        self.sampler = RoundSampler(c.samples, c.run.seed, self.dataset.tokenizer, self.forwards)
        if c.outer.verify:
            self.verifier = Verifier(c, self.dataset, self.forwards)
            try:  # what the verifier knew before a restart: nobody's record starts clean again
                self.verifier.restore(self.ledger.verifier_state())
            except Exception:
                log.exception("cannot read the verifier's records from the ledger: every peer starts anew")
        if self.device.type != "cpu":
            log.info(
                "scoring, evaluation and samples on %s; θ, its steps and checkpoints on CPU", self.device
            )

    @torch.no_grad()
    def _load(self, params: Mapping[str, torch.Tensor], round_: int) -> None:
        for name, tensor in self.theta.items():
            tensor.copy_(params[name])
        self.held = round_

    # --- on the event loop -------------------------------------------------------------------------

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="bookkeeping")

    def needs_base(self, round_: int) -> bool:
        """Whether round `round_` must bring a snapshot of θ^{round_-1}: the copy will not hold it, or
        MAX_PENDING rounds wait already (a snapshot then supersedes them)."""
        waiting = sum(1 for work in self._pending if work.step is not None)
        return self._lost or self._tail != round_ - 1 or waiting >= MAX_PENDING

    def submit(self, work: RoundWork) -> None:
        if work.base is not None:
            for older in self._pending:  # the snapshot holds what their steps would have made
                older.superseded, older.step, older.base, older.scorable = True, None, None, []
            self._lost = False
        self._pending.append(work)
        self._tail = work.round
        self._in_hand += 1
        self._observe_lag()
        self._wake.set()

    @property
    def lag(self) -> int:
        """Rounds handed over that the worker has not finished (0: it is idle, all done)."""
        return self._in_hand

    async def close(self, timeout_s: float = STOP_WAIT_S) -> None:
        """Drop the rounds waiting (credited, `skipped`), end the phase in hand, and wait at most
        `timeout_s` for the worker to finish."""
        self._stopping.set()
        self._wake.set()
        if self._task is None:
            return
        try:
            await asyncio.wait_for(asyncio.shield(self._task), timeout_s)
        except TimeoutError:
            log.warning("the bookkeeping worker did not stop within %.0f s", timeout_s)

    def recover(self, history: Iterable[Mapping[str, Any]]) -> list[dict[str, Any]]:
        """Evaluated lines for the rounds a crash left with a seal line only: their contributors are
        credited as sealed (unscored: the verifier's averages did not survive the crash either)."""
        lines = []
        for entry in history:
            if entry.get(EVALUATED) is not False or not isinstance(entry.get("credits"), dict):
                continue
            credits = [
                Contribution(
                    peer, c["name"], c["role"], c["tokens"], c["steps"], c["bytes"], c.get("replica_tokens")
                )
                for peer, c in entry["credits"].items()
            ]
            try:
                self.ledger.record_round(entry["round"], float(entry["time"]), credits)
            except Exception:
                log.exception("round %d: the ledger refused the recovered credits", entry["round"])
            lines.append(
                {"round": entry["round"], EVALUATED: True, "skipped": True, "recovered": True}
                | {"tokens": sum(c.tokens for c in credits), "scores": {}}
            )
            log.info("round %d: credited after a restart (sealed, never evaluated)", entry["round"])
        return lines

    async def _run(self) -> None:
        while True:
            if not self._pending:
                if self._stopping.is_set():
                    return
                await self._wake.wait()
                self._wake.clear()
                continue
            batch = list(self._pending)
            self._pending.clear()
            self._observe_lag()
            try:
                lines = await asyncio.to_thread(self._process, batch)
            except Exception:  # never the end of the worker: the next round brings a snapshot
                log.exception("rounds %d-%d: bookkeeping failed", batch[0].round, batch[-1].round)
                self.held, self._lost = None, True
                lines = []
            for line in lines:
                try:
                    self.record(line)
                except Exception:
                    log.exception("round %d: writing its evaluated line failed", line["round"])
            self._in_hand -= len(batch)
            if self.metrics is not None:
                self.metrics.bookkeeping_skipped.inc(sum(1 for line in lines if line.get("skipped")))
            self._observe_lag()

    def _observe_lag(self) -> None:
        if self.metrics is not None:
            self.metrics.bookkeeping_lag.set(self.lag)

    # --- in the worker's thread --------------------------------------------------------------------

    def _process(self, batch: list[RoundWork]) -> list[dict[str, Any]]:
        """Every round of `batch` in order: the newest in full, the older ones stepped and credited."""
        return [self._one(work, full=work is batch[-1]) for work in batch]

    def _one(self, work: RoundWork, full: bool) -> dict[str, Any]:
        started = time.perf_counter()
        full = full and not work.superseded and not self._stopping.is_set()
        line: dict[str, Any] = {"round": work.round, EVALUATED: True, "skipped": not full}
        holds = not work.superseded and not self._stopping.is_set() and self._take_base(work)
        scores: dict[str, float] = {}
        if holds and full and work.step is not None and self.verifier is not None and work.scorable:
            try:
                scores = self.verifier.score(
                    work.round, self.forward_theta(), work.scorable, work.replicas, work.steps or None
                )
                line["verify_seconds"] = round(self.verifier.last_seconds, 3)
            except Exception:  # its contributions stay unscored: judged on the averages so far
                log.exception("round %d: scoring failed", work.round)
        stepped = holds and self._step(work)
        if not work.catch_up:
            line |= self._credit(work, scores)
        if stepped and full and self._evaluation_due(work.round):
            line |= self._evaluate(work.round)
        if stepped and not self._stopping.is_set() and self._checkpoint_due(work):
            self._checkpoint(work)
        if self._stopping.is_set() and "eval_loss" not in line:
            line["skipped"] = True  # the stop came first
        line["bookkeeping_seconds"] = round(time.perf_counter() - started, 3)
        line["evaluated_at"] = time.time()
        return line

    def _take_base(self, work: RoundWork) -> bool:
        """Whether the copy holds θ before `work`'s step (θ^t itself for a catch-up), loading the
        snapshot `work` brings."""
        if work.base is not None:
            self._load(work.base, work.base_round if work.base_round is not None else work.round - 1)
            work.base = None
        wanted = work.round - 1 if work.step is not None else work.round
        if self.held != wanted:
            log.warning(
                "round %d: the worker's θ is of round %s, not %d; waiting for a snapshot",
                work.round,
                self.held,
                wanted,
            )
            self.held, self._lost = None, True
            return False
        return True

    @torch.no_grad()
    def _step(self, work: RoundWork) -> bool:
        if work.step is not None:
            o = self.config.outer
            delta = work.step.delta
            outer_sgd_step({n: self.theta[n] for n in delta}, delta, lr=o.lr, weight_decay=o.weight_decay)
            work.step = None
        self.held = work.round
        return True

    def _credit(self, work: RoundWork, scores: Mapping[str, float]) -> dict[str, Any]:
        """Verdicts (with the round's scores when it was scored) and the ledger's rows for the round."""
        verdicts: list[Verdict] = []
        if self.verifier is not None:
            verdicts = self.verifier.verdicts(work.round, work.sealed, work.rejected, scores)
            for v in verdicts:
                if v.reason is not None:
                    log.info(
                        "round %d: no credit for %s (%s, average %s)", work.round, v.peer, v.reason, v.average
                    )
        refused = {v.peer for v in verdicts if v.reason is not None}
        credits = [c for c in work.credits if c.peer not in refused]
        try:
            self.ledger.record_round(work.round, work.sealed_at, credits)
            self.ledger.record_verdicts(verdicts)
        except Exception:  # the ledger is a view of the rounds: its failure must not stop them
            log.exception("round %d: the ledger refused the round's credits", work.round)
        self._swarm_tokens += sum(c.tokens for c in credits)
        epochs = self._passes_over_data(work.round)
        return {
            "data_epochs": epochs,
            "rejected": {v.peer: v.reason for v in verdicts if v.reason is not None}
            if self.verifier is not None
            else dict(work.rejected),
            "scores": {v.peer: round(v.score, 4) for v in verdicts if v.score is not None},
            "tokens": sum(c.tokens for c in credits),  # credited: verified work only
        }

    def _passes_over_data(self, round_: int) -> float | None:
        """The swarm's credited tokens over the run's training tokens; past `train.max_epochs`, said once
        (an error line: the model may be memorising its corpus). Nothing stops: credits are claims a
        verifier weighed, not a reason to halt everyone's run."""
        train_tokens = getattr(getattr(self, "dataset", None), "train_tokens", 0)
        if train_tokens <= 0:
            return None
        epochs = self._swarm_tokens / train_tokens
        limit = self.config.train.max_epochs
        if limit > 0 and epochs > limit and not self._epochs_told:
            self._epochs_told = True
            log.error(
                "round %d: the swarm has trained %s tokens, %.1f passes over the run's %s training tokens "
                "(train.max_epochs %g): the model may be memorising its corpus; point data.source at more "
                "data (docs/operations.md, 'A large corpus')",
                round_,
                f"{self._swarm_tokens:,}",
                epochs,
                f"{train_tokens:,}",
                limit,
            )
        return round(epochs, 4)

    def _evaluation_due(self, round_: int) -> bool:
        """Whether `round_` reaches a multiple of `train.eval_every_rounds` not evaluated yet."""
        every = self.config.train.eval_every_rounds
        return round_ // every > self._evaluated // every

    def _evaluate(self, round_: int) -> dict[str, Any]:
        out: dict[str, Any] = {}
        self._evaluated = round_  # a failure costs this round's evaluation: the next is K rounds on
        try:
            out["eval_loss"] = self.evaluate()
            if self.metrics is not None:
                self.metrics.observe_eval(out["eval_loss"])
        except Stopped:
            return out
        except Exception:
            log.exception("round %d: evaluation failed", round_)
        if self.sampler is not None and self.sampler.enabled and not self._stopping.is_set():
            try:
                out["sample"] = self.sampler.sample(self.theta, round_)
            except Exception:
                log.exception("round %d: sampling failed", round_)
        log.info("round %d evaluated: eval loss %s", round_, out.get("eval_loss"))
        return out

    @torch.no_grad()
    def evaluate(self) -> float:
        """Eval loss of the copy's θ over the eval batches, on the device (Stopped when the coordinator
        stops)."""
        self.forward_theta()
        total = 0.0
        for inputs, targets in self._eval_batches:
            if self._stopping.is_set():
                raise Stopped
            with autocast_for(self.device):
                total += self.forwards.loss(inputs, targets).item()
        return total / len(self._eval_batches)

    @torch.no_grad()
    def forward_theta(self) -> dict[str, torch.Tensor]:
        """The copy's θ in the device's model, its weights returned (on CPU they are θ); never copied back."""
        if self.forwards is self.model:
            return self.theta
        weights = {name: p.detach() for name, p in self.forwards.named_parameters()}
        for name, tensor in weights.items():
            tensor.copy_(self.theta[name])
        return weights

    def _checkpoint_due(self, work: RoundWork) -> bool:
        every = self.config.outer.checkpoint_every_rounds
        return work.catch_up or work.round // every > self._checkpointed // every

    def _checkpoint(self, work: RoundWork) -> None:
        digests = layer_digests(self.theta)
        if work.digests and digests != work.digests:
            log.error(
                "round %d: the worker's θ is not the sealed θ; no checkpoint, a snapshot next", work.round
            )
            self.held, self._lost = None, True
            return
        try:
            with self.checkpoint_lock:
                folder = store_params(
                    self.checkpoints,
                    self.theta,
                    work.round,
                    work.seal_hash,
                    digests,
                    self.config,
                    self.run_id,
                )
        except Exception:
            log.exception("round %d: writing the checkpoint failed", work.round)
            return
        self._checkpointed = work.round
        if folder is not None:
            log.info("round %d: θ written to %s", work.round, folder)
