"""Protocol-level fault modes of an anchor, for tests and benchmarks only (`hetnode join --fault`, hidden):
`stale` trains from θ several rounds old (and says so in its header, as a slow honest peer would), `copy`
re-labels another peer's payload of the round as its own (TRUST §4: what verification must catch). Honest
peers keep an unsealed payload from all but its sealers (`held_payloads`), so the copier asks its author and
the coordinator and, refused by both, announces its own work."""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from dataclasses import dataclass

import torch

from hetnode.net.node import SwarmNode
from hetnode.net.signing import open_payload
from hetnode.net.streams import PeerRequestError
from hetnode.replica.global_model import GlobalModel
from hetnode.training.faults import STALE_ROUNDS

log = logging.getLogger(__name__)

COPY_WAIT_S = 60.0


@dataclass
class OldTheta:
    """What `AnchorTraining.run_round` reads of a global model: θ, its round and its shards."""

    params: dict[str, torch.Tensor]
    params_round: int
    shards: dict[str, list[str]]


class StaleTheta:
    """Keeps θ of the last STALE_ROUNDS rounds; a stale anchor trains from the oldest."""

    def __init__(self) -> None:
        self._kept: deque[OldTheta] = deque(maxlen=STALE_ROUNDS + 1)

    def train_from(self, global_model: GlobalModel) -> OldTheta:
        params = {name: t.clone() for name, t in global_model.params.items()}
        self._kept.append(OldTheta(params, global_model.params_round, global_model.shards))
        return self._kept[0]


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
