"""θ after a round from a peer that holds it, shard by shard: how a replica catches up from the sealer and
how the coordinator, after a restart, catches up from a replica."""

from __future__ import annotations

import asyncio

from hetnode.net.node import SwarmNode
from hetnode.replica.global_model import GlobalModel

STATE_FETCH_PARALLEL = 4  # state shards asked of the source at once (its budget: 8 streams per peer)


async def fetch_state(
    node: SwarmNode,
    source: str,
    global_model: GlobalModel,
    round_: int,
    expect_digests: dict[str, str] | None = None,
) -> None:
    """Download θ after `round_` shard by shard from `source` and load it (all or nothing), checked
    against the layer digests the source publishes for that round when we have them."""
    payloads = await download_state(node, source, global_model, round_)
    await asyncio.to_thread(global_model.load_state, round_, payloads, expect_digests)


async def download_state(
    node: SwarmNode, source: str, global_model: GlobalModel, round_: int
) -> dict[str, bytes]:
    """θ after `round_` from `source`: every shard's dense payload, not yet decoded or checked."""
    max_bytes = int(global_model.config.network.max_frame_mb * 2**20)
    # the source serves only the round it holds: the download must end within a round. In parallel, a
    # far peer pays its RTT (stream set-up, slow start) about once, not once per shard; a few at a time
    # stay inside the source's streams-per-peer budget
    slots = asyncio.Semaphore(STATE_FETCH_PARALLEL)

    async def one(shard: str) -> tuple[str, bytes]:
        async with slots:
            return shard, await node.fetch_state(source, round_, shard, max_bytes)

    return dict(await asyncio.gather(*(one(shard) for shard in global_model.shards)))
