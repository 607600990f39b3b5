"""The coordinator's half of a sync round: collect announcements, seal (`hetnode/daemon/sealing.py`), apply
the same aggregate to its own copy of θ, evaluate, checkpoint every K rounds, and serve sealed payloads
and state.

After a restart (or a crash between checkpoints) the swarm may hold rounds the coordinator does not: its
own last seal is newer than its checkpoint, or anchors sealed in its place while it was away. It then
takes θ from the replicas that hold the newest round, trusting only parameters whose layer digests match
what the majority of those replicas publish, and seals from the next round on.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections import Counter, deque
from pathlib import Path
from typing import Any

import torch

from bootstrap.ledger import Contribution, Ledger
from bootstrap.swarm_metrics import REPLICA_ROLES, SwarmMetrics
from hetnode.config import Config
from hetnode.daemon.datadir import DataDir
from hetnode.daemon.lifecycle import sleep_or_stop, sleep_or_wake
from hetnode.daemon.participant import fetch_state
from hetnode.daemon.presence import Presence
from hetnode.daemon.rounds import GlobalModel, base_fixed_embedding
from hetnode.daemon.sealing import SealedRound, Sealer
from hetnode.daemon.view import RecentView, SwarmView
from hetnode.data.dataset import TokenDataset
from hetnode.errors import WireError
from hetnode.model.decoder import build_model
from hetnode.net.node import SwarmNode
from hetnode.net.streams import PeerRequestError
from hetnode.planning.rounds import Announcement, seal_now

log = logging.getLogger(__name__)

POLL_S = 0.5  # announcements are also nudged to us: this is the fallback and the deadline's resolution
CHECKPOINT = "global.pt"
HISTORY = "rounds.jsonl"
HISTORY_KEPT = 500  # rounds kept in memory for the status page


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
    ) -> None:
        self.config = config
        self.node = node
        self.presence = presence
        self.data_dir = data_dir
        self.ledger = ledger  # credit for sealed contributions only (DESIGN §3.5)
        self.metrics = metrics
        self.history: deque[dict[str, Any]] = deque(read_history(data_dir.path), maxlen=HISTORY_KEPT)
        self.global_model = GlobalModel(config)
        self.sealer = Sealer(config, node, self.global_model)
        self.view = RecentView(node, config, max_age_s=config.network.heartbeat_s)
        self._load_checkpoint()
        node.set_payloads(self.sealer.serve)
        node.set_state(self._serve_state)
        self._announced = asyncio.Event()  # a replica nudged us: its announcement is in the DHT
        node.set_nudge_handler(self._on_nudge)

    def _on_nudge(self, peer: str, topic: str, round_: int) -> None:
        if topic == "announce":
            self._announced.set()

    def _serve_state(self, round_: int, shard: str) -> bytes | None:
        if round_ != self.global_model.params_round or shard not in self.global_model.shards:
            return None
        return self.global_model.state_payload(shard)

    async def run(self, stop: asyncio.Event) -> None:
        evaluator = await asyncio.to_thread(self._build_evaluator)
        seen: dict[str, Announcement] = {}
        round_ = self.global_model.params_round + 1
        try:
            newest, checked_at = -1, -float("inf")
            while not await sleep_or_wake(stop, self._announced, POLL_S):
                # seals by others change rarely (a restart, a stand-in): look once per heartbeat, not per poll
                if time.monotonic() - checked_at >= self.config.network.heartbeat_s:
                    newest, checked_at = await self._newest_sealed_round(), time.monotonic()
                if newest > self.global_model.params_round:
                    if not await self._catch_up_from_replicas(newest, evaluator):
                        await sleep_or_stop(stop, 1.0)
                    continue
                round_ = self.global_model.params_round + 1
                if any(a.round != round_ for a in seen.values()):
                    seen = {}
                await self._poll(round_, seen, evaluator)
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
        self.sealer.observe_arrivals(expected, seen)
        await self._record(sealed, started, evaluator)

    # --- after a restart: rounds the swarm sealed without us ----------------------------------------

    async def _newest_sealed_round(self) -> int:
        """The newest round sealed by us (in an earlier life) or by an anchor standing in for us."""
        own = self.node.identity.peer_id
        newest, stand_ins = -1, {}
        for peer, entry in (await self.node.read_field("seal")).items():
            round_ = entry.value.get("round") if isinstance(entry.value, dict) else None
            if not isinstance(round_, int):
                continue
            if peer == own:
                newest = max(newest, round_)
            elif round_ > self.global_model.params_round:
                stand_ins[peer] = round_
        if stand_ins:  # only an anchor may seal in our place
            view = await SwarmView.read(self.node, self.config)
            for peer, round_ in stand_ins.items():
                if view.peers.get(peer, {}).get("role") == "anchor":
                    newest = max(newest, round_)
        return newest

    async def _catch_up_from_replicas(self, round_: int, evaluator: Any) -> bool:
        """Take θ after `round_` from a replica whose parameters match the majority's layer digests."""
        view = await SwarmView.read(self.node, self.config)
        holders = {
            peer: tuple(sorted(record["layer_digests"].items()))
            for peer, record in view.peers.items()
            if record["role"] in ("anchor", "stage")
            and record["params_round"] == round_
            and record["layer_digests"]
        }
        if not holders:
            log.info("round %d was sealed without us; waiting for a replica that holds it", round_)
            return False
        (majority, votes), *_ = Counter(holders.values()).most_common(1)
        for peer in sorted(p for p, digests in holders.items() if digests == majority):
            try:  # all or nothing, and only θ whose layers match the majority's digests
                await fetch_state(self.node, peer, self.global_model, round_, dict(majority))
            except (PeerRequestError, WireError) as exc:
                log.warning("catch-up from %s failed: %s", peer, exc)
                continue
            await asyncio.to_thread(self._checkpoint)
            eval_loss = await asyncio.to_thread(evaluator, self.global_model)
            digests = self.global_model.digests()
            await self.presence.update(params_round=round_, layer_digests=digests, outer_step=round_)
            self._append_history(
                {
                    "round": round_,
                    "contributors": [],  # sealed without us: we took the result, not the contributions
                    "excluded": [],
                    "tokens": 0,
                    "eval_loss": eval_loss,
                    "seal_seconds": 0.0,
                    "layer_digests": digests,
                    "time": time.time(),
                    "caught_up_from": peer,
                }
            )
            log.info(
                "caught up to round %d from %s (%d of %d replicas agree), eval loss %.4f",
                round_,
                peer,
                votes,
                len(holders),
                eval_loss,
            )
            return True
        return False

    async def _record(self, sealed: SealedRound, started: float, evaluator: Any) -> None:
        """Apply the sealed round to the coordinator's θ, evaluate, checkpoint, append to the history."""
        round_ = sealed.record["round"]
        await asyncio.to_thread(self.global_model.apply_decoded, round_, sealed.decoded)  # checked at sealing
        credits = await self._credit(sealed)
        eval_loss = await asyncio.to_thread(evaluator, self.global_model)
        if round_ % self.config.outer.checkpoint_every_rounds == 0:
            await asyncio.to_thread(self._checkpoint)
        digests = self.global_model.digests()
        await self.presence.update(params_round=round_, layer_digests=digests, outer_step=round_)
        entry = {
            "round": round_,
            "contributors": [peer for peer, _ in sealed.contributions],
            "excluded": sealed.excluded,
            # tokens trained: one count per replica (an anchor, or a chain's first stage: "embed")
            "tokens": sum(c["tokens"] for c in sealed.record["contributions"] if "embed" in c["shards"]),
            "eval_loss": eval_loss,
            "seal_seconds": round(time.monotonic() - started, 3),
            "layer_digests": digests,
            "time": time.time(),
            "payload_bytes": {
                role: sum(c.bytes_sent for c in credits if c.role == role) for role in REPLICA_ROLES
            },
            "dense_bytes": sum(self.global_model.dense_bytes(p) for _, p in sealed.contributions),
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

    async def _credit(self, sealed: SealedRound) -> list[Contribution]:
        """Write the ledger rows of a sealed round: tokens and steps as announced, bytes as fetched."""
        peers = (await self.view.get()).peers
        shards = set(self.global_model.shards)
        credits = []
        for peer, payloads in sealed.contributions:
            announcement = sealed.announcements[peer]
            record = peers.get(peer, {})
            credits.append(
                Contribution(
                    peer=peer,
                    name=record.get("name") or peer[-8:],
                    # from what it sent, not from its record: a full replica sends every shard
                    role="anchor" if set(payloads) == shards else "stage",
                    tokens=announcement.tokens,
                    inner_steps=announcement.steps,
                    bytes_sent=sum(len(data) for data in payloads.values()),
                )
            )
        await asyncio.to_thread(
            self.ledger.record_round, sealed.record["round"], sealed.record["sealed_at"], credits
        )
        return credits

    def _append_history(self, entry: dict[str, Any]) -> None:
        with open(self.data_dir.path / HISTORY, "a") as history:
            history.write(json.dumps(entry) + "\n")
        self.history.append(entry)

    @property
    def eval_loss(self) -> float | None:
        """Of the global θ after the newest round in the history."""
        return self.history[-1]["eval_loss"] if self.history else None

    # --- evaluation and checkpoints -----------------------------------------------------------------

    def _build_evaluator(self):
        dataset = TokenDataset.build(self.config.data, self.config.model.vocab_size, self.config.run.seed)
        model = build_model(self.config.model, seed=self.config.run.seed)
        model.fixed_embedding = base_fixed_embedding(self.config)  # the architecture anchors train
        batches = dataset.eval_batches(self.config.train.eval_batches)

        @torch.no_grad()
        def evaluate(global_model: GlobalModel) -> float:
            for name, param in model.named_parameters():
                param.copy_(global_model.params[name])
            model.eval()
            return sum(model.loss(x, y).item() for x, y in batches) / len(batches)

        return evaluate

    def _checkpoint(self) -> None:
        path: Path = self.data_dir.path / CHECKPOINT
        tmp = path.with_suffix(".tmp")
        torch.save({"params_round": self.global_model.params_round, "params": self.global_model.params}, tmp)
        tmp.replace(path)

    def _load_checkpoint(self) -> None:
        path = self.data_dir.path / CHECKPOINT
        if not path.exists():
            return
        state = torch.load(path, map_location="cpu", weights_only=True)
        params = state["params"]
        if set(params) != set(self.global_model.params):
            raise WireError("checkpoint", f"{path} holds another model")
        with torch.no_grad():
            for name, tensor in params.items():
                self.global_model.params[name].copy_(tensor)
        self.global_model.params_round = int(state["params_round"])
        log.info("global model restored at round %d from %s", self.global_model.params_round, path)
