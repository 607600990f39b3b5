"""The coordinator's half of a sync round: collect announcements, seal (`hetnode/daemon/sealing.py`), apply
the same aggregate to its own copy of θ, evaluate, checkpoint, and serve sealed payloads and state."""

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
from hetnode.daemon.rounds import GlobalModel, base_fixed_embedding
from hetnode.daemon.sealing import SealedRound, Sealer, expected_contributors
from hetnode.data.dataset import TokenDataset
from hetnode.errors import WireError
from hetnode.model.decoder import build_model
from hetnode.net.node import SwarmNode
from hetnode.planning.rounds import Announcement, seal_now

log = logging.getLogger(__name__)

POLL_S = 0.25
CHECKPOINT = "global.pt"
HISTORY = "rounds.jsonl"


class RoundKeeper:
    def __init__(self, config: Config, node: SwarmNode, presence: Presence, data_dir: DataDir) -> None:
        self.config = config
        self.node = node
        self.presence = presence
        self.data_dir = data_dir
        self.global_model = GlobalModel(config)
        self.sealer = Sealer(config, node, self.global_model)
        self._load_checkpoint()
        node.set_payloads(self.sealer.serve)
        node.set_state(self._serve_state)

    def _serve_state(self, round_: int, shard: str) -> bytes | None:
        if round_ != self.global_model.params_round or shard not in self.global_model.shards:
            return None
        return self.global_model.state_payload(shard)

    async def run(self, stop: asyncio.Event) -> None:
        evaluator = await asyncio.to_thread(self._build_evaluator)
        seen: dict[str, Announcement] = {}
        round_ = self.global_model.params_round + 1
        while not await sleep_or_stop(stop, POLL_S):
            await self.sealer.collect(round_, seen)
            if not seen:
                continue
            expected = await expected_contributors(self.node, self.config, round_)
            if not seal_now(expected, seen, time.monotonic(), self.sealer.deadline.seconds):
                continue
            started = time.monotonic()
            sealed = await self.sealer.seal(round_, seen)
            if sealed is None:
                continue
            self.sealer.observe_arrivals(expected, seen)
            await self._record(sealed, started, evaluator)
            seen, round_ = {}, round_ + 1

    async def _record(self, sealed: SealedRound, started: float, evaluator: Any) -> None:
        """Apply the sealed round to the coordinator's θ, evaluate, checkpoint, append to the history."""
        round_ = sealed.record["round"]
        await asyncio.to_thread(self.global_model.apply, round_, sealed.contributions)
        eval_loss = await asyncio.to_thread(evaluator, self.global_model)
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
        }
        with open(self.data_dir.path / HISTORY, "a") as history:
            history.write(json.dumps(entry) + "\n")
        log.info(
            "round %d sealed: %d contributions, %d excluded, eval loss %.4f",
            round_,
            len(sealed.contributions),
            len(sealed.excluded),
            eval_loss,
        )

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
