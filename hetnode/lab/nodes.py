"""In-process swarm nodes on loopback, for the lab's network microbenchmarks and the tests.

`async with nodes_on_loopback(count, run) as nodes:` starts `count` `SwarmNode`s (each its own identity and
p2pd) on 127.0.0.1; with a `run`, each joins that run's DHT. The first node bootstraps the rest, unless
`initial_peers` names a swarm that runs already (a hostile peer joining it). Leaving shuts every node down,
newest first, p2pd included, also on an error or a cancellation while they start or run.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Sequence

from hetnode.net.identity import ephemeral_identity
from hetnode.net.node import DEFAULT_LIMITS, NodeLimits, SwarmNode

log = logging.getLogger(__name__)

LOOPBACK = ["/ip4/127.0.0.1/tcp/0"]


@contextlib.asynccontextmanager
async def nodes_on_loopback(
    count: int,
    run: str | None = None,
    limits: NodeLimits = DEFAULT_LIMITS,
    *,
    initial_peers: Sequence[str] = (),
    coordinator: str | None = None,
) -> AsyncIterator[list[SwarmNode]]:
    """`count` nodes; with `run`, all in its DHT (checked against `coordinator`'s fields when given). Without
    `initial_peers` the first node starts alone and the others reach it at its loopback address."""
    nodes: list[SwarmNode] = []
    try:
        peers = list(initial_peers)
        for _ in range(count):
            node = await SwarmNode.start(ephemeral_identity(), limits, LOOPBACK, initial_peers=peers)
            nodes.append(node)
            if run is not None:
                await node.join_dht(run, peers, coordinator=coordinator)
            if not peers:  # the first node of a swarm of our own: the others join through it
                peers = await node.visible_maddrs()
        yield nodes
    finally:
        await shut_down(nodes)


async def shut_down(nodes: Sequence[SwarmNode]) -> None:
    """Every node, newest first (one that is stopped already is skipped by `SwarmNode.shutdown`). A
    cancellation does not cut this short: the rest still go, then the cancellation goes on."""
    cancelled: asyncio.CancelledError | None = None
    for node in reversed(nodes):
        try:
            await asyncio.shield(node.shutdown())
        except asyncio.CancelledError as exc:
            cancelled = exc
        except Exception as exc:  # one node's failure must not leave the others' p2pd running
            log.warning("shutting down a loopback node: %r", exc)
    if cancelled is not None:
        raise cancelled
