"""The coordinator's half of a sync round: collect announcements, validate the payloads behind them, seal,
apply the same aggregate to its own copy of θ, evaluate, checkpoint, and serve sealed payloads and state.

A contribution enters the seal only after the coordinator fetched every shard from its author, checked
the sha256 against the announcement and decoded it against the model (shapes, index ranges, finite
tables). Anything else is excluded, logged with the peer id, and the peer is banned for a while, so the
seal lists only payloads every replica can apply: nobody drops a contribution on its own.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from pathlib import Path
from typing import Any

import torch

from hetnode.config import Config
from hetnode.daemon.datadir import DataDir
from hetnode.daemon.lifecycle import sleep_or_stop
from hetnode.daemon.presence import Presence
from hetnode.daemon.rounds import GlobalModel, sha256_hex
from hetnode.daemon.view import SwarmView
from hetnode.data.dataset import TokenDataset
from hetnode.errors import WireError
from hetnode.model.decoder import build_model
from hetnode.net.node import SwarmNode
from hetnode.net.streams import PeerRequestError
from hetnode.planning.rounds import Announcement, ArrivalDeadline, seal_now, sealed_order

log = logging.getLogger(__name__)

POLL_S = 0.25
BAN_S = 120.0
CHECKPOINT = "global.pt"
HISTORY = "rounds.jsonl"


class RoundKeeper:
    def __init__(self, config: Config, node: SwarmNode, presence: Presence, data_dir: DataDir) -> None:
        self.config = config
        self.node = node
        self.presence = presence
        self.data_dir = data_dir
        self.global_model = GlobalModel(config)
        self.sealed_payloads: dict[tuple[int, str, str], bytes] = {}  # (round, replica, shard) -> bytes
        self.banned: dict[str, float] = {}
        n = config.network
        self.deadline = ArrivalDeadline(
            floor_s=max(1.0, n.heartbeat_s), ceiling_s=max(30.0, 10 * n.boundary_s)
        )
        self._load_checkpoint()
        node.set_payloads(self._serve_payload)
        node.set_state(self._serve_state)

    # --- serving ------------------------------------------------------------------------------------

    def _serve_payload(self, round_: int, shard: str, replica: str) -> bytes | None:
        return self.sealed_payloads.get((round_, replica, shard))

    def _serve_state(self, round_: int, shard: str) -> bytes | None:
        if round_ != self.global_model.params_round or shard not in self.global_model.shards:
            return None
        return self.global_model.state_payload(shard)

    # --- the loop -----------------------------------------------------------------------------------

    async def run(self, stop: asyncio.Event) -> None:
        evaluator = await asyncio.to_thread(self._build_evaluator)
        seen: dict[str, Announcement] = {}
        round_ = self.global_model.params_round + 1
        while not await sleep_or_stop(stop, POLL_S):
            now = time.monotonic()
            for peer, entry in (await self.node.read_field("announce")).items():
                value = entry.value
                if value.get("round") != round_ or peer in seen or self.banned.get(peer, 0) > now:
                    continue
                seen[peer] = Announcement(peer, round_, dict(value["shards"]), value["tokens"], now)
            if not seen:
                continue
            expected = await self._expected_replicas()
            if not seal_now(expected, seen, now, self.deadline.seconds):
                continue
            arrived = [a.seen_at for p, a in seen.items() if p in expected] or [now]
            self.deadline.observe(max(arrived) - min(a.seen_at for a in seen.values()))
            await self._seal(round_, seen, evaluator)
            seen, round_ = {}, round_ + 1

    async def _expected_replicas(self) -> set[str]:
        entries = await self.node.read_field("peers")
        view = SwarmView.from_entries(entries, self.config.pipeline.stages, self.config.model.n_layers)
        return {peer for peer, record in view.peers.items() if record["role"] == "anchor"}

    async def _seal(self, round_: int, seen: dict[str, Announcement], evaluator: Any) -> None:
        started = time.monotonic()
        good: list[tuple[Announcement, dict[str, bytes]]] = []
        excluded = []
        for announcement in sealed_order(seen.values()):
            try:
                payloads = await self._fetch_and_check(announcement)
            except (PeerRequestError, WireError) as exc:
                log.warning("round %d: excluding peer %s: %s", round_, announcement.peer_id, exc)
                excluded.append(announcement.peer_id)
                self.banned[announcement.peer_id] = time.monotonic() + BAN_S
                continue
            good.append((announcement, payloads))
        for announcement, payloads in good:
            for shard, data in payloads.items():
                self.sealed_payloads[(round_, announcement.peer_id, shard)] = data
        self.sealed_payloads = {k: v for k, v in self.sealed_payloads.items() if k[0] >= round_ - 1}
        record = {
            "round": round_,
            "contributions": [
                {"peer": a.peer_id, "shards": dict(a.shards), "tokens": a.tokens} for a, _ in good
            ],
            "excluded": excluded,
            "sealed_at": time.time(),
        }
        await asyncio.to_thread(self.global_model.apply, round_, [(a.peer_id, p) for a, p in good])
        await self.node.store_own("seal", record, ttl_s=3600.0)
        eval_loss = await asyncio.to_thread(evaluator, self.global_model)
        await asyncio.to_thread(self._checkpoint)
        digests = self.global_model.digests()
        await self.presence.update(params_round=round_, layer_digests=digests, outer_step=round_)
        entry = {
            "round": round_,
            "contributors": [a.peer_id for a, _ in good],
            "excluded": excluded,
            "tokens": sum(a.tokens for a, _ in good),
            "eval_loss": eval_loss,
            "seal_seconds": round(time.monotonic() - started, 3),
            "layer_digests": digests,
            "time": time.time(),
        }
        with open(self.data_dir.path / HISTORY, "a") as history:
            history.write(json.dumps(entry) + "\n")
        log.info(
            "round %d sealed: %d contributions, %d excluded, eval loss %.4f",
            round_,
            len(good),
            len(excluded),
            eval_loss,
        )

    async def _fetch_and_check(self, announcement: Announcement) -> dict[str, bytes]:
        max_bytes = int(self.config.network.max_frame_mb * 2**20)
        if set(announcement.shards) != set(self.global_model.shards):
            raise WireError("shards", "the announcement does not cover every shard")
        payloads = {}
        for shard, digest in announcement.shards.items():
            data = await self.node.fetch_payload(
                announcement.peer_id, announcement.round, shard, announcement.peer_id, max_bytes
            )
            if sha256_hex(data) != digest:
                raise WireError(f"shards.{shard}", "payload differs from its announced sha256")
            payloads[shard] = data
        await asyncio.to_thread(
            self.global_model.decode_contribution, announcement.peer_id, announcement.round, payloads
        )
        return payloads

    # --- evaluation and checkpoints -----------------------------------------------------------------

    def _build_evaluator(self):
        dataset = TokenDataset.build(self.config.data, self.config.model.vocab_size, self.config.run.seed)
        model = build_model(self.config.model, seed=self.config.run.seed)
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


def read_history(data_dir: Path) -> list[dict[str, Any]]:
    path = Path(data_dir) / HISTORY
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
