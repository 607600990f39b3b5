"""The anchor role over the network: train H inner steps, announce the payload digests, wait for the seal,
fetch exactly the sealed payloads, check their digests, apply the same outer step as every replica.

Round t of an anchor (DESIGN §3.5):
1. train from θ^t in a worker thread (the event loop keeps serving handlers and the heartbeat);
2. keep the encoded payload per shard in memory, serve it, announce `{round, shards: sha256, tokens}`;
3. wait for the coordinator's seal of round t;
4. fetch every sealed contribution (its own from memory, others from the coordinator, which validated them
   before sealing), verify each sha256 against the seal, then apply all of them or none;
5. publish `params_round` and `layer_digests` in its record: the check that replicas agree.
"""

from __future__ import annotations

import asyncio
import logging
import time
from pathlib import Path
from typing import Any

import msgpack

from hetnode.config import Config
from hetnode.daemon.lifecycle import sleep_or_stop
from hetnode.daemon.presence import Presence
from hetnode.daemon.rounds import AnchorTraining, GlobalModel, sha256_hex
from hetnode.daemon.sealing import Sealer
from hetnode.daemon.view import SwarmView
from hetnode.data.dataset import TokenDataset
from hetnode.errors import HetnodeError, WireError
from hetnode.net.node import SwarmNode
from hetnode.net.streams import PeerRequestError
from hetnode.planning.rounds import Announcement, seal_now

log = logging.getLogger(__name__)

ANNOUNCE_TTL_S = 300.0
POLL_S = 0.25


class RoundFailed(HetnodeError):
    """A sealed round could not be applied here (payload unavailable or invalid): catch up from state."""


async def read_seal(node: SwarmNode, coordinator: str) -> dict[str, Any] | None:
    entry = (await node.read_field("seal")).get(coordinator)
    return entry.value if entry is not None and isinstance(entry.value, dict) else None


async def fetch_state(node: SwarmNode, coordinator: str, global_model: GlobalModel, round_: int) -> None:
    """Download θ after `round_` shard by shard from the coordinator and load it (all or nothing)."""
    max_bytes = int(global_model.config.network.max_frame_mb * 2**20)
    payloads = {}
    for shard in global_model.shards:
        payloads[shard] = await node.fetch_state(coordinator, round_, shard, max_bytes)
    global_model.load_state(round_, payloads)


class AnchorLoop:
    def __init__(
        self,
        config: Config,
        node: SwarmNode,
        presence: Presence,
        coordinator: str,
        device: str,
        state_path: Path,
        fault: str | None = None,
    ) -> None:
        self.config = config
        self.node = node
        self.presence = presence
        self.coordinator = coordinator
        self.device = device
        self.state_path = state_path
        self.fault = fault  # tests only: "nan" or "digest" makes this anchor a hostile contributor
        self.peer_id = node.identity.peer_id
        self.global_model = GlobalModel(config)
        self.outbox: dict[int, dict[str, bytes]] = {}
        self.sealer = Sealer(config, node, self.global_model, self._own_payload)
        node.set_payloads(self._serve_payload)

    def _own_payload(self, round_: int, shard: str) -> bytes | None:
        return self.outbox.get(round_, {}).get(shard)

    def _serve_payload(self, round_: int, shard: str, replica: str) -> bytes | None:
        if replica == self.peer_id:
            return self._own_payload(round_, shard)
        return self.sealer.serve(
            round_, shard, replica
        )  # rounds this anchor sealed in the coordinator's place

    async def run(self, stop: asyncio.Event) -> None:
        dataset = await asyncio.to_thread(
            TokenDataset.build, self.config.data, self.config.model.vocab_size, self.config.run.seed
        )
        training = AnchorTraining(self.config, dataset, self.peer_id, self.device)
        if await asyncio.to_thread(training.load_local_state, self.state_path, self.global_model):
            log.info(
                "resumed local state: round %d, %d inner steps, error-feedback norm %.6f",
                self.global_model.params_round,
                training.trainer.step,
                training.feedback_norm(),
            )
        await self._catch_up(stop)
        while not stop.is_set():
            round_ = self.global_model.params_round + 1
            started, tokens_before = time.monotonic(), training.tokens
            payloads = await asyncio.to_thread(training.run_round, round_, self.global_model)
            payloads = self._maybe_corrupt(payloads)
            self.outbox = {r: p for r, p in self.outbox.items() if r >= round_ - 1}
            self.outbox[round_] = payloads
            digests = {shard: sha256_hex(data) for shard, data in payloads.items()}
            if self.fault == "digest":
                digests = {shard: sha256_hex(b"not " + data) for shard, data in payloads.items()}
            announcement = {
                "round": round_,
                "shards": digests,
                "tokens": training.tokens - tokens_before,  # this round's: what the ledger will credit
                "steps": self.config.outer.inner_steps,
            }
            log.info(
                "round %d trained in %.1f s (loss %.3f): announcing",
                round_,
                time.monotonic() - started,
                training.last_loss,
            )
            sealed = await self._wait_for_seal(round_, announcement, stop)
            if sealed is None:
                return
            try:
                await self._apply(*sealed)
            except RoundFailed as exc:
                log.warning("round %d: %s; catching up from the coordinator", round_, exc)
                await self._catch_up(stop)
                continue
            await asyncio.to_thread(training.save_local_state, self.state_path, self.global_model)
            await self.presence.update(
                params_round=self.global_model.params_round,
                layer_digests=self.global_model.digests(),
                tokens=training.tokens,
                outer_step=self.global_model.params_round,
            )

    def _maybe_corrupt(self, payloads: dict[str, bytes]) -> dict[str, bytes]:
        if self.fault != "nan":
            return payloads
        return {shard: _nan_payload(data) for shard, data in payloads.items()}

    async def _wait_for_seal(
        self, round_: int, announcement: dict, stop: asyncio.Event
    ) -> tuple[str, dict] | None:
        """(sealer, seal) for `round_` or later. The coordinator seals; when it is silent (its record has
        expired) the lowest-id live anchor seals in its place, and every anchor accepts that seal too."""
        announced_at = 0.0
        waiting_since = time.monotonic()
        seen: dict[str, Announcement] = {}
        while not stop.is_set():
            if time.monotonic() - announced_at > ANNOUNCE_TTL_S / 3:  # (re)announce until sealed
                await self.node.store_own("announce", announcement, ANNOUNCE_TTL_S)
                announced_at = time.monotonic()
            view = await self._view()
            anchors = sorted(p for p, r in view.peers.items() if r["role"] == "anchor")
            stand_in = anchors[0] if anchors and self.coordinator not in view.peers else None
            seals = await self.node.read_field("seal")
            for sealer in (self.coordinator, stand_in):
                entry = seals.get(sealer) if sealer else None
                if (
                    entry is not None
                    and isinstance(entry.value, dict)
                    and entry.value.get("round", -1) >= round_
                ):
                    return sealer, entry.value
            silent_for = time.monotonic() - waiting_since
            if stand_in == self.peer_id and silent_for > self.config.network.record_ttl_s:
                await self.sealer.collect(round_, seen)
                if seal_now(set(anchors), seen, time.monotonic(), self.sealer.deadline.seconds):
                    log.warning("round %d: the coordinator is silent; sealing in its place", round_)
                    self.sealer.observe_arrivals(set(anchors), seen)
                    sealed = await self.sealer.seal(round_, seen)
                    return self.peer_id, sealed.record
            if await sleep_or_stop(stop, POLL_S):
                return None
        return None

    async def _view(self) -> SwarmView:
        return await SwarmView.read(self.node, self.config)

    async def _apply(self, sealer: str, seal: dict) -> None:
        round_ = seal["round"]
        if round_ != self.global_model.params_round + 1:
            raise RoundFailed(
                f"the seal is for round {round_}, we hold round {self.global_model.params_round}"
            )
        max_bytes = int(self.config.network.max_frame_mb * 2**20)
        contributions = []
        for contribution in seal["contributions"]:
            peer, payloads = contribution["peer"], {}
            for shard, digest in contribution["shards"].items():
                here = peer == self.peer_id or sealer == self.peer_id  # our payload, or a round we sealed
                own = self._serve_payload(round_, shard, peer) if here else None
                try:
                    data = (
                        own
                        if own is not None
                        else await self.node.fetch_payload(sealer, round_, shard, peer, max_bytes)
                    )
                except PeerRequestError as exc:
                    raise RoundFailed(f"cannot fetch {peer[-8:]}'s shard {shard}: {exc}") from None
                if sha256_hex(data) != digest:
                    raise RoundFailed(f"{peer[-8:]}'s shard {shard} does not match the sealed digest")
                payloads[shard] = data
            contributions.append((peer, payloads))
        try:
            await asyncio.to_thread(self.global_model.apply, round_, contributions)
        except WireError as exc:
            raise RoundFailed(f"a sealed payload is invalid: {exc}") from None
        log.info(
            "round %d applied: %d contributions, digest %s",
            round_,
            len(contributions),
            self.global_model.digests().get("embed", "?"),
        )

    async def _catch_up(self, stop: asyncio.Event) -> None:
        """If the swarm has sealed rounds we do not hold, download θ from the coordinator."""
        while not stop.is_set():
            seal = await read_seal(self.node, self.coordinator)
            if seal is None or seal["round"] == self.global_model.params_round:
                return  # nothing sealed yet, or we hold exactly the sealed θ
            try:
                await fetch_state(self.node, self.coordinator, self.global_model, seal["round"])
                log.info("caught up: holding θ after round %d", self.global_model.params_round)
                return
            except (PeerRequestError, WireError) as exc:
                log.info("catch-up to round %d not ready (%s); retrying", seal["round"], exc)
            if await sleep_or_stop(stop, 1.0):
                return


def _nan_payload(data: bytes) -> bytes:
    """Tests only: the same message with every tensor's quantisation shift set to NaN."""
    message = msgpack.unpackb(data, raw=False)
    for entry in message["tensors"]:
        entry["q"][0] = float("nan")
    return msgpack.packb(message, use_bin_type=True, use_single_float=True)
