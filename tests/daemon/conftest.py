"""Fixtures of the daemon tests: real p2pd nodes on one DHT over loopback."""

import contextlib
from collections.abc import AsyncIterator, Callable

import pytest

from hetnode.net.identity import ephemeral_identity
from hetnode.net.node import NodeLimits, SwarmNode

LOOPBACK = ["/ip4/127.0.0.1/tcp/0"]
LIMITS = NodeLimits(probe_bytes=2**20, probe_s=3.0, requests_per_min=600)


@contextlib.asynccontextmanager
async def running_nodes(count: int, run: str) -> AsyncIterator[list[SwarmNode]]:
    """`count` nodes on one DHT, all shut down on exit (a node a test stopped already is stopped again)."""
    nodes = [await SwarmNode.start(ephemeral_identity(), LIMITS, LOOPBACK)]
    try:
        await nodes[0].join_dht(run, [])
        maddrs = await nodes[0].visible_maddrs()
        for _ in range(count - 1):
            nodes.append(await SwarmNode.start(ephemeral_identity(), LIMITS, LOOPBACK, initial_peers=maddrs))
            await nodes[-1].join_dht(run, maddrs)
        yield nodes
    finally:
        for node in reversed(nodes):
            await node.shutdown()


@pytest.fixture
def nodes_on_loopback() -> Callable:
    """`async with nodes_on_loopback(count, run) as nodes`: see `running_nodes`."""
    return running_nodes
