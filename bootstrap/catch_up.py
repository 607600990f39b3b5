"""The coordinator's catch-up after a restart: θ of rounds the swarm sealed without it, from a replica.

A coordinator that returns after a crash between checkpoints, or after listed stand-ins sealed in its
place while it was away, holds older θ than the swarm. Before it seals anything in this life
(`RoundKeeper`), it takes θ of the newest such round from any replica that holds it, trusting only
parameters whose layer digests match what that round's sealer signed: its own history for its rounds, the
stand-in's signed peer record for the stand-in's rounds. Never a vote of replicas, which Sybils would win;
and anyone else's seal is noise.

Anyone can claim to hold a round (the digests are public), and a liar can answer as slowly as the stream
timeouts allow. So holders are asked CATCH_UP_PARALLEL at a time, each within a deadline of its own; those
that contributed to our recent seals first, the rest in an order of our own (random, not by peer id, which
identities can be ground to lead): a catch-up ends in bounded time however many holders lie.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections import deque
from collections.abc import Awaitable, Callable
from typing import Any

from hetnode.config import Config
from hetnode.errors import WireError
from hetnode.net.node import SwarmNode
from hetnode.net.streams import PeerRequestError
from hetnode.protocol.state_fetch import download_state
from hetnode.protocol.swarm_view import SwarmView
from hetnode.replica.global_model import GlobalModel
from hetnode.wire.seals import seal_digest

log = logging.getLogger(__name__)

CATCH_UP_PARALLEL = 3  # holders asked for θ at once
RECENT_SEALS = 16  # contributors to this many of our last seals are asked first


class CatchUp:
    """Finds a trusted seal newer than the coordinator's θ and takes that round's θ from a replica. What
    follows a catch-up is the keeper's: `append_history` the round's entry (`history` is the keeper's, read
    for our own digests), `publish` its round and digests, and `settled`: evaluate, sample and checkpoint
    it beside the next rounds (`bootstrap/bookkeeping.py`)."""

    def __init__(
        self,
        config: Config,
        node: SwarmNode,
        global_model: GlobalModel,
        stand_ins: tuple[str, ...],
        history: deque[dict[str, Any]],
        publish: Callable[[int, dict[str, str]], Awaitable[None]],
        append_history: Callable[[dict[str, Any]], None],
        settled: Callable[[int, dict[str, str]], Awaitable[None]],
    ) -> None:
        self.config = config
        self.node = node
        self.global_model = global_model
        self.stand_ins = stand_ins
        self.history = history
        self.publish = publish
        self.append_history = append_history
        self.settled = settled
        self._newer: tuple[str, dict[str, Any]] | None = None
        self._checked_at = -float("inf")

    async def due(self, sealed_in_this_life: bool) -> tuple[str, dict[str, Any]] | None:
        """(sealer, seal) to catch up to before the next round, or None."""
        # seals missed while away change rarely: look once per heartbeat, and only until we seal
        if not sealed_in_this_life and time.monotonic() - self._checked_at >= self.config.network.heartbeat_s:
            self._newer, self._checked_at = await self.newer_trusted_seal(), time.monotonic()
        newer = self._newer
        return newer if newer is not None and newer[1]["round"] > self.global_model.params_round else None

    async def newer_trusted_seal(self) -> tuple[str, dict[str, Any]] | None:
        """(sealer, seal) of the newest round sealed by us in an earlier life, or by a stand-in of the
        manifest, that is newer than the θ we hold; None when there is none. Anyone else's seal is noise."""
        held = self.global_model.params_round
        best: tuple[str, dict[str, Any]] | None = None
        seals = await self.node.read_field("seal")
        for sealer in (self.node.identity.peer_id, *self.stand_ins):
            entry = seals.get(sealer)
            seal = entry.value if entry is not None and isinstance(entry.value, dict) else None
            if seal is None or not isinstance(seal.get("round"), int) or seal["round"] <= held:
                continue
            if best is None or seal["round"] > best[1]["round"]:
                best = (sealer, seal)
        return best

    def trusted_digests(self, sealer: str, round_: int, view: SwarmView) -> dict[str, str] | None:
        """θ's layer digests after `round_` as its sealer signed them: our own history for our seals, the
        stand-in's own record for its seals."""
        if sealer == self.node.identity.peer_id:
            entries = [h for h in self.history if h["round"] == round_ and h.get("layer_digests")]
            return dict(entries[-1]["layer_digests"]) if entries else None
        record = view.peers.get(sealer, {})
        if record.get("params_round") == round_ and record.get("layer_digests"):
            return dict(record["layer_digests"])
        return None

    async def from_replicas(self, sealer: str, seal: dict[str, Any]) -> bool:
        """θ after `seal`'s round from any replica that holds it, checked against the sealer's digests."""
        round_ = seal["round"]
        view = await SwarmView.read(self.node, self.config)
        digests = self.trusted_digests(sealer, round_, view)
        if digests is None:
            log.info("round %d was sealed by %s; waiting for its signed digests", round_, sealer[-8:])
            return False
        holders = self.ranked_holders(view, round_, digests, sealer)
        peer = await self._take_state(holders, round_, digests)
        if peer is not None:
            self.global_model.seal_hash = seal_digest(seal)
            self.append_history(
                {
                    "round": round_,
                    "contributors": [],  # sealed without us: we took the result, not the contributions
                    "excluded": [],
                    "tokens": 0,
                    "eval_loss": None,  # the evaluated line brings it
                    "seal_seconds": 0.0,
                    "layer_digests": digests,
                    "seal_hash": self.global_model.seal_hash,
                    "time": time.time(),
                    "caught_up_from": peer,
                    "sealed_by": sealer,
                    "sample": None,
                }
            )
            await self.publish(round_, digests)
            await self.settled(round_, digests)  # evaluated, sampled and checkpointed beside the rounds
            log.info("caught up to round %d from %s (sealed by %s)", round_, peer, sealer)
            return True
        if not holders:
            log.info("round %d was sealed without us; waiting for a replica that holds it", round_)
        return False

    def ranked_holders(self, view: SwarmView, round_: int, digests: dict[str, str], sealer: str) -> list[str]:
        """Who claims θ of `round_` with the sealer's digests, in the order we ask: the stand-in that sealed
        it, then our recent contributors, then the rest; random within each group."""
        me = self.node.identity.peer_id
        claims = [
            peer
            for peer, record in view.peers.items()
            if record["role"] in ("anchor", "stage")
            and record["params_round"] == round_
            and record["layer_digests"] == digests
            and peer != me
        ]
        recent = {
            peer for entry in list(self.history)[-RECENT_SEALS:] for peer in entry.get("contributors", [])
        }
        shuffle = random.SystemRandom().shuffle
        known, others = [p for p in claims if p in recent], [p for p in claims if p not in recent]
        shuffle(known)
        shuffle(others)
        first = [sealer] if sealer in view.peers and sealer != me else []
        return first + [peer for peer in known + others if peer not in first]

    def holder_deadline_s(self) -> float:
        """How long one holder may take to serve θ: twice θ's transfer at an anchor's slowest admitted
        link, and at least 15 s."""
        n = self.config.network
        state_bytes = 4 * sum(t.numel() for t in self.global_model.params.values())
        return max(15.0, 2 * state_bytes * 8 / (max(n.anchor_min_up_mbps, 1.0) * 1e6))

    async def _take_state(self, holders: list[str], round_: int, digests: dict[str, str]) -> str | None:
        """Load θ of `round_` from the first holder whose download completes in time and matches the
        digests (all or nothing); the holder, or None when none did."""
        deadline_s = self.holder_deadline_s()
        waiting = list(holders)
        asking: dict[asyncio.Task, str] = {}
        try:
            while waiting or asking:
                while waiting and len(asking) < CATCH_UP_PARALLEL:
                    peer = waiting.pop(0)
                    download = download_state(self.node, peer, self.global_model, round_)
                    asking[asyncio.create_task(asyncio.wait_for(download, deadline_s))] = peer
                done, _ = await asyncio.wait(asking, return_when=asyncio.FIRST_COMPLETED)
                for task in done:
                    peer = asking.pop(task)
                    try:
                        payloads = task.result()
                        await asyncio.to_thread(self.global_model.load_state, round_, payloads, digests)
                    except TimeoutError:
                        log.warning("catch-up from %s: no θ within %.0f s; asking others", peer, deadline_s)
                        continue
                    except (PeerRequestError, WireError) as exc:
                        log.warning("catch-up from %s failed: %s", peer, exc)
                        continue
                    return peer
            return None
        finally:
            for task in asking:
                task.cancel()
            await asyncio.gather(*asking, return_exceptions=True)
