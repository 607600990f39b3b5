"""Fixtures of the daemon tests: real p2pd nodes on one DHT over loopback (`hetnode/lab/nodes.py`)."""

import functools
from collections.abc import Callable

import pytest

from hetnode.lab.nodes import nodes_on_loopback as loopback_nodes
from hetnode.net.node import NodeLimits

LIMITS = NodeLimits(probe_bytes=2**20, probe_s=3.0, requests_per_min=600)

# `count` nodes on one DHT, all shut down on exit (a node a test stopped already is stopped again)
running_nodes = functools.partial(loopback_nodes, limits=LIMITS)


@pytest.fixture
def nodes_on_loopback() -> Callable:
    """`async with nodes_on_loopback(count, run) as nodes`: see `hetnode.lab.nodes.nodes_on_loopback`."""
    return running_nodes
