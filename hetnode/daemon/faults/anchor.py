"""An anchor's faults, for tests and benchmarks only (docs/security.md, "Send useless or harmful work": what
verification and the checks must catch).

Work faults, whose payloads are valid: the pseudo-gradient faults of `hetnode.training.faults` (noise,
signflip, scaled, freerider: what Δ the round sends, without error feedback), `stale` (trains from θ
several rounds old and says so in its header, as a slow honest peer would) and `copy` (re-labels another
peer's payload of the round as its own; honest peers keep an unsealed payload from all but its sealers,
`held_payloads`, so the copier asks its author and the coordinator and, refused by both, announces its own
work). Hostile payloads: `nan` (a NaN quantisation shift in every tensor), `digest` (announced digests that
fit no payload). A faulty replica: `drift` (one flipped bit of θ after round 1, which the digest check must
notice and repair)."""

from __future__ import annotations

import asyncio
import logging
from collections import deque

import msgpack
import torch

from hetnode.algo.sparseloco import CompressedTensor, ErrorFeedback, SparseLoCoCodec
from hetnode.config import OuterConfig
from hetnode.daemon.faults.strategy import Faults, OldTheta
from hetnode.net.node import SwarmNode
from hetnode.net.signing import open_payload
from hetnode.net.streams import PeerRequestError
from hetnode.planning.rounds import NUM_DATA_SLOTS, data_slot
from hetnode.replica.global_model import GlobalModel, sha256_hex
from hetnode.training.faults import STALE_ROUNDS, corrupt
from hetnode.training.local_rounds import LocalRounds

log = logging.getLogger(__name__)

COPY_WAIT_S = 60.0
DRIFT_AFTER_ROUND = 1  # the θ round whose bit flips: after the first sealed round, once


class PseudoGradientFault(Faults):
    """Sends `corrupt(name, Δ)` in place of Δ. It keeps no error feedback: what it sends is exactly its
    fault, round after round, and it has nothing to restore."""

    closes_aside = False

    def __init__(self, name: str) -> None:
        self.name = name

    def round_update(
        self, local: LocalRounds, round_: int, peer_id: str, outer: OuterConfig
    ) -> dict[str, CompressedTensor]:
        seed = round_ * NUM_DATA_SLOTS + data_slot(peer_id)  # each faulty peer its own noise
        delta = corrupt(self.name, local.pseudo_gradient(), outer.max_value, seed=seed)
        fresh = ErrorFeedback(SparseLoCoCodec(outer.topk, outer.tile), outer.error_feedback)
        compressed = fresh.compress(delta)
        local.keep_progress()
        return compressed


class Stale(Faults):
    """Keeps θ of the last STALE_ROUNDS rounds and trains each round from the oldest."""

    name = "stale"

    def __init__(self) -> None:
        self._kept: deque[OldTheta] = deque(maxlen=STALE_ROUNDS + 1)

    def train_from(self, global_model: GlobalModel) -> OldTheta:
        params = {name: t.clone() for name, t in global_model.params.items()}
        self._kept.append(OldTheta(params, global_model.params_round, global_model.shards))
        return self._kept[0]


class Copy(Faults):
    """Announces another peer's payload of the round as ours, if it can get it in time."""

    name = "copy"

    async def announced_payloads(
        self,
        node: SwarmNode,
        global_model: GlobalModel,
        round_: int,
        payloads: dict[str, bytes],
        stop: asyncio.Event,
    ) -> dict[str, bytes]:
        copied = await copied_payloads(node, global_model, round_, stop)
        return copied or payloads


class NanPayloads(Faults):
    """Serves each shard's message with every tensor's quantisation shift set to NaN."""

    name = "nan"

    def payload_bytes(self, payloads: dict[str, bytes]) -> dict[str, bytes]:
        return {shard: nan_payload(data) for shard, data in payloads.items()}


class WrongDigests(Faults):
    """Announces digests that fit none of the payloads it serves."""

    name = "digest"

    def announced_digests(self, digests: dict[str, str], payloads: dict[str, bytes]) -> dict[str, str]:
        return {shard: sha256_hex(b"not " + data) for shard, data in payloads.items()}


class Drift(Faults):
    """Flips the lowest bit of one weight of θ after round 1, as a silent fault in memory or a diverging
    kernel would (once: the digest check repairs it by a catch-up, which it must not undo)."""

    name = "drift"

    def after_apply(self, global_model: GlobalModel) -> bool:
        if global_model.params_round != DRIFT_AFTER_ROUND:
            return False
        name = sorted(global_model.params)[0]
        bits = global_model.params[name].view(-1).view(torch.int32)
        bits[0] ^= 1
        global_model.changed()
        log.warning("fault injection: flipped one bit of %s", name)
        return True


def nan_payload(data: bytes) -> bytes:
    """The same message with every tensor's quantisation shift set to NaN."""
    message = msgpack.unpackb(data, raw=False)
    for entry in message["tensors"]:
        entry["q"][0] = float("nan")
    return msgpack.packb(message, use_bin_type=True, use_single_float=True)


async def copied_payloads(
    node: SwarmNode, global_model: GlobalModel, round_: int, stop: asyncio.Event
) -> dict[str, bytes] | None:
    """Another peer's payload messages of `round_` with our peer id in place of its own (None: nobody to
    copy from in time). Ed25519 peer ids have one length, so the re-labelled message stays well-formed."""
    own = node.identity.peer_id
    max_bytes = int(global_model.config.network.max_frame_mb * 2**20)
    waited = 0.0
    while waited < COPY_WAIT_S and not stop.is_set():
        announced = await node.read_field("announce")
        victims = sorted(
            peer
            for peer, entry in announced.items()
            if peer != own and isinstance(entry.value, dict) and entry.value.get("round") == round_
        )
        for victim in victims:
            shards = list(announced[victim].value.get("shards", {}))
            if len(victim) != len(own) or not set(shards) <= set(global_model.shards):
                continue
            for holder in dict.fromkeys([victim, node.coordinator or victim]):  # its author, the sealer
                try:
                    wanted = [(s, victim) for s in shards]
                    found = await node.fetch_payloads(holder, round_, wanted, max_bytes)
                except PeerRequestError as exc:
                    log.info("copy: %s does not give us %s's payload: %s", holder, victim, exc)
                    continue
                messages = {}
                for shard, data in zip(shards, found, strict=True):
                    _, body = open_payload(node.run or "", data, max_bytes)
                    messages[shard] = body.replace(victim.encode(), own.encode())
                log.warning("fault injection: announcing %s's payload of round %d as ours", victim, round_)
                return messages
            # refused by both (the round is not sealed): asking the next victim would only make us late
            log.warning("fault injection: no payload of round %d to copy; announcing our own", round_)
            return None
        await asyncio.sleep(1.0)
        waited += 1.0
    return None
