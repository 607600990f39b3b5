"""A chain stage that leaves hands its error feedback to the spare that takes its stage (docs/chains.md, "A
spare steps in").

A stage's error feedback is what its earlier rounds still owe θ: the part of each Δ that top-k left unsent.
A stage stopped by a signal (`hetnode join` gets SIGINT or SIGTERM) says it is offline, so its chain's
successor is planned at the next boundary, and stays up to serve that feedback, shard by shard, as dense
fp32 payloads (`FeedbackHandoff`), until the spare has taken it, nobody is left to take it, or
`handoff_window_s` is over (a second signal ends it at once); taken means the spare said so
(`feedback_taken`), not that the bytes left us. It serves the feedback as it holds it when it
stops: every payload it announced counts as sent (one its round's seal leaves out is lost, as the round in
flight is). A stage that was killed takes its feedback with it: the spare starts from zero, as a new chain
does.

Only the spare that took the stage may ask: a peer that works at the leaver's stage and layers in a live
chain of its lineage holding one of its old members. A claim in a record is free to make, but a chain is
live only once every member claims it, the old member included. One taker: a second asker is refused.

The spare (`take_feedback`) asks the members the plan names as the stage's predecessors (`ChainPlan.
predecessors`: left, never caught lying), checks every shard (`decode_payload`: names, shapes, finite in fp32)
and the whole (`feedback_refusal`), tells the leaver it has it, and hands it to its stage, which adds it to
its own at its next `compress`. Its training does not wait: a predecessor that is gone, slow or lying costs
the feedback, never the round.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence

import torch

from hetnode.algo.sparseloco import DenseCodec, feedback_refusal, tensors_norm
from hetnode.config import Config
from hetnode.errors import WireError
from hetnode.net.budgets import Refused
from hetnode.net.node import SwarmNode
from hetnode.net.streams import PeerRequestError
from hetnode.planning.roles import stage_pools
from hetnode.protocol.swarm_view import SwarmView
from hetnode.wire.sync_payload import ShardSpec, SyncPayload, decode_payload, encode_payload

log = logging.getLogger(__name__)

TAKE_TIMEOUT_S = 30.0  # the most one shard's transfer may take before the spare goes on without it
TAKE_TRIES, TAKE_RETRY_S = 3, 2.0  # a predecessor that refused or did not answer is asked again
# how often a leaving stage reads the records for whether anyone is left to take its feedback (read now,
# not vouched for by the coordinator's digest, which lags: when a whole swarm stops, its stages exit soon)
CHECK_EVERY_S = 1.0

ReadView = Callable[..., Awaitable[SwarmView]]  # (max_age_s=None) -> the records


def handoff_window_s(config: Config) -> float:
    """How long a leaving stage waits for its successor: the next boundary, the claims' confirmation and
    the spare's start, with a boundary to spare."""
    n = config.network
    return 2 * n.boundary_s + n.confirm_s


class FeedbackHandoff:
    """A leaving stage's error feedback, served to the spare that took its stage (see the module)."""

    def __init__(
        self,
        own: str,
        stage: int,
        layers: tuple[int, int],
        members: Sequence[str],
        lineage: str,
        feedback: Mapping[str, torch.Tensor],
        shards: Mapping[str, Sequence[str]],
        params_round: int,
        read_view: ReadView,
    ) -> None:
        """`members`: the chain's other members as we left it; `feedback`: our buffers (copied here);
        `shards`: shard -> the names of our stage's tensors in it; `params_round`: the θ they stand on."""
        self.own = own
        self.stage = stage
        self.layers = layers
        self.members = frozenset(members) - {own}
        self.lineage = lineage
        self.feedback = {n: t.detach().to("cpu", torch.float32).clone() for n, t in feedback.items()}
        self.shards = {shard: list(names) for shard, names in shards.items()}
        self.params_round = max(params_round, 0)
        self._view = read_view
        self.taker: str | None = None
        self._served: set[str] = set()
        self.done = asyncio.Event()
        self.norm = tensors_norm(self.feedback)

    async def serve(self, shard: str, asker: str) -> bytes | None:
        """Our feedback for `shard`, for the spare that took our stage; `Refused` for anyone else."""
        if shard not in self.shards:
            return None
        if self.taker not in (None, asker):
            raise Refused("taken", "this stage's error feedback went to its successor already")
        if self.taker is None:
            problem = self.taker_problem(await self._view(max_age_s=1.0), asker)
            if problem is not None:  # the successor may be newer than our last read
                problem = self.taker_problem(await self._view(max_age_s=0), asker)
            if problem is not None:
                log.info("error feedback refused to %s: %s", asker[-8:], problem)
                raise Refused("not_successor", f"only the spare that took this stage may ask: {problem}")
            self.taker = asker
        data = await asyncio.to_thread(self._encode, shard)
        self._served.add(shard)
        return data

    def taken(self, asker: str) -> bool:
        """The spare says it holds every shard, checked. Only its word ends the handoff: bytes handed to
        our p2pd may still be on their way, and exiting would cut them off (seen: a spare read 131 of 165
        kB, then found us gone)."""
        if asker != self.taker or self._served != set(self.shards):
            return False
        if not self.done.is_set():
            log.info("handed error feedback (norm %.6f) to %s", self.norm, asker[-8:])
            self.done.set()
        return True

    def taker_problem(self, view: SwarmView, asker: str) -> str | None:
        """Why `asker` may not take our feedback (None: it may)."""
        record = view.peers.get(asker) or {}
        status = next((c for c in view.chains() if c.live and c.chain == record.get("chain")), None)
        if status is None:
            return "not in a live chain"
        if status.lineage != self.lineage:
            return "not in a chain of our lineage"
        pools = stage_pools(status.layout)
        if self.stage >= len(pools) or asker not in pools[self.stage][0]:
            return f"not at stage {self.stage}"
        if (pools[self.stage][1], pools[self.stage][2]) != self.layers:
            return "not holding our layers"
        if not status.members & self.members:
            return "its chain holds none of our chain's members"
        return None

    def _encode(self, shard: str) -> bytes:
        codec = DenseCodec("fp32")
        tensors = {name: codec.compress(self.feedback[name]) for name in self.shards[shard]}
        return encode_payload(SyncPayload(self.own, self.params_round, shard, "fp32", tensors))

    def anyone_to_take(self, view: SwarmView) -> bool:
        """Whether a successor may still come: one of our old members still works at a stage (the
        survivor, waiting for a spare or already in the successor)."""
        return any((view.peers.get(peer) or {}).get("role") == "stage" for peer in self.members)

    async def wait(self, window_s: float, quit_now: asyncio.Event) -> str:
        """Until the feedback is taken, nobody is left to take it, `window_s` is over or `quit_now`."""
        deadline = time.monotonic() + window_s
        while not self.done.is_set():
            if quit_now.is_set():
                return "stopped again"
            if time.monotonic() >= deadline:
                return f"not taken within {window_s:.0f} s"
            if self.taker is None:
                try:
                    if not self.anyone_to_take(await self._view(max_age_s=0)):
                        return "nobody left to take it"
                except Exception as exc:  # the records could not be read: look again
                    log.debug("records unreadable while handing off: %r", exc)
            waiters = [asyncio.ensure_future(e.wait()) for e in (self.done, quit_now)]
            await asyncio.wait(waiters, timeout=CHECK_EVERY_S, return_when=asyncio.FIRST_COMPLETED)
            for waiter in waiters:
                waiter.cancel()
        return "taken"


async def take_feedback(
    node: SwarmNode,
    config: Config,
    predecessors: Sequence[str],
    shards: Mapping[str, Sequence[str]],
    theta: Mapping[str, torch.Tensor],
) -> tuple[str, dict[str, torch.Tensor]] | None:
    """The error feedback one of `predecessors` (who held our stage and left) serves us, checked: (its
    peer id, name -> tensor), or None when none served it."""
    for peer in predecessors:
        feedback = None
        for attempt in range(1, TAKE_TRIES + 1):
            try:
                feedback = await _fetch_feedback(node, config, peer, shards, theta)
                break
            except WireError as exc:  # what it served is not feedback for our stage: not asked again
                log.info("no error feedback from our stage's predecessor %s: %s", peer[-8:], exc)
                break
            except (PeerRequestError, OSError, TimeoutError) as exc:
                # its records may not show our chain live yet: it refuses us until they do
                log.info("no error feedback from %s (try %d of %d): %s", peer[-8:], attempt, TAKE_TRIES, exc)
                await asyncio.sleep(TAKE_RETRY_S)
        if feedback is None:
            continue
        problem = await asyncio.to_thread(feedback_refusal, feedback, theta)  # a slice's norms: off the loop
        if problem is not None:
            log.warning("error feedback from %s refused: %s", peer[-8:], problem)
            continue
        try:  # the leaver stays until we say so
            await asyncio.wait_for(node.confirm_feedback(peer), TAKE_TIMEOUT_S)
        except (PeerRequestError, WireError, OSError, TimeoutError) as exc:
            log.info("could not tell %s that we took its error feedback: %s", peer[-8:], exc)
        return peer, feedback
    return None


async def _fetch_feedback(
    node: SwarmNode,
    config: Config,
    peer: str,
    shards: Mapping[str, Sequence[str]],
    theta: Mapping[str, torch.Tensor],
) -> dict[str, torch.Tensor]:
    """Every shard of `peer`'s feedback for our stage, decoded and checked (`decode_payload`)."""
    max_bytes = int(config.network.max_frame_mb * 2**20)
    o = config.outer
    feedback: dict[str, torch.Tensor] = {}
    for shard, names in shards.items():
        spec = ShardSpec(shard, {n: tuple(theta[n].shape) for n in names}, "fp32", o.topk, o.tile, max_bytes)
        data = await asyncio.wait_for(node.fetch_feedback(peer, shard, max_bytes), TAKE_TIMEOUT_S)
        decoded = await asyncio.to_thread(decode_payload, data, spec)
        if decoded.replica != peer:
            raise WireError("replica", f"feedback signed as {decoded.replica[-8:]}")
        feedback.update(decoded.dense)
    return feedback
