"""Second opinions in a stage pool, over real p2pd nodes on loopback: a first stage and the workers of the
last stage's pool are the daemon's own stages (`ChainLoop`, compressed boundaries), one worker handed the
`grad-signflip` fault as `hetnode join --fault` hands it (every gradient frame it sends upstream negated:
its norm is honest, so only a second opinion shows it). Every micro-batch also goes to a second worker
(`pipeline.audit_share = 1`): of three workers, the one whose gradients point against the two others' is
caught lying, dropped and blamed, and the first stage ends its round with the two honest workers, who
never disagree; of two, the first stage cannot tell which lies: the chain breaks, blaming nobody."""

from __future__ import annotations

import asyncio
import contextlib
import time
from pathlib import Path

import pytest

from hetnode.config import Config, replace
from hetnode.daemon.chain import ChainLoop
from hetnode.daemon.chain_links import ChainLayout
from hetnode.daemon.faults.factory import faults_named
from hetnode.net import loop
from hetnode.net.identity import ephemeral_identity
from hetnode.net.node import SwarmNode
from hetnode.net.records import new_peer_record
from hetnode.service.presence import Presence

pytestmark = pytest.mark.slow

WITHIN_S = 150.0  # start-up (θ, the data, the streams) and a round of H micro-batches on tiny
LIAR = "grad-signflip"


@pytest.fixture(scope="module")
def config(tiny_config: Config) -> Config:
    """tiny, every micro-batch audited, with a heartbeat slower than the test: no chain records are
    published here, so the stages' member watch must not end the chain."""
    config = replace(tiny_config, "network", heartbeat_s=60.0, record_ttl_s=120.0, stable_heartbeat_s=60.0)
    return replace(config, "pipeline", audit_share=1.0, stage_workers=3)


def chain_of(config: Config, nodes: list[SwarmNode], data_dir: Path, liar: int) -> list[ChainLoop]:
    """A chain of node 0 (first stage) and a pool of the others (last stage); node `liar` lies."""
    n = config.model.n_layers
    splits = (range(0, n // 2), range(n // 2, n))
    ids = [node.identity.peer_id for node in nodes]
    pools = ((ids[0],), tuple(ids[1:]))
    coordinator = ephemeral_identity().peer_id
    chains = []
    for i, node in enumerate(nodes):
        index = 0 if i == 0 else 1
        layout = ChainLayout("chain-x", index, pools, splits)
        n_cfg = config.network
        presence = Presence(
            node, new_peer_record(f"node-{i}", role="stage"), n_cfg.heartbeat_s, n_cfg.record_ttl_s
        )
        (data_dir / f"node-{i}").mkdir(parents=True, exist_ok=True)
        fault = LIAR if i == liar else None
        chains.append(
            ChainLoop(
                config,
                node,
                presence,
                coordinator,
                layout,
                data_dir / f"node-{i}",
                faults=faults_named(fault),
            )
        )
    return chains


async def until(condition, what: str) -> None:
    deadline = time.monotonic() + WITHIN_S
    while not condition():
        assert time.monotonic() < deadline, f"not within {WITHIN_S} s: {what}"
        await asyncio.sleep(0.2)


@contextlib.asynccontextmanager
async def running(nodes_on_loopback, config: Config, data_dir: Path, workers: int):
    """A chain of a first stage and a pool of `workers`, the last of them the liar, running until the block
    ends: yields (its stages, their runs, the nodes)."""
    async with nodes_on_loopback(1 + workers, f"opinions-{workers}") as nodes:
        chains = chain_of(config, nodes, data_dir, liar=workers)
        stop = asyncio.Event()
        runs = [asyncio.create_task(chain.run(stop)) for chain in chains]
        try:
            yield chains, runs, nodes
        finally:
            stop.set()
            await asyncio.wait_for(asyncio.gather(*runs, return_exceptions=True), 60)


def test_of_three_workers_the_one_that_flips_its_gradients_is_dropped_and_the_round_goes_on(
    nodes_on_loopback, config, tmp_path
):
    async def scenario() -> None:
        async with running(nodes_on_loopback, config, tmp_path, 3) as (chains, _, nodes):
            first, liar = chains[0], nodes[3].identity.peer_id
            await until(
                lambda: first.blamed is not None or (first.failed is not None and first.failed.done()),
                "a blame",
            )
            assert first.blamed == liar, (first.blamed, first.failed)
            # the round goes on with the two honest workers, who audit each other and always agree
            await until(
                lambda: first.failed.done() or (first.target is not None and first.backwards >= first.target),
                "the round",
            )
            assert not first.failed.done(), first.failed.result()
            assert first.links.downs[liar].lost
            honest = [first.links.downs[p.identity.peer_id] for p in nodes[1:3]]
            assert not any(link.lost for link in honest)
            assert sum(link.served for link in honest) >= first.target  # all of it, and the copies
            assert all(chain.blamed is None for chain in chains[1:])

    loop.run(scenario())


def test_of_two_workers_one_flipping_its_gradients_breaks_the_chain_and_no_one_is_blamed(
    nodes_on_loopback, config, tmp_path
):
    async def scenario() -> None:
        async with running(nodes_on_loopback, config, tmp_path, 2) as (chains, runs, _):
            reason = await asyncio.wait_for(runs[0], WITHIN_S)
            assert "one of them lies, and with two this stage cannot tell which" in reason, reason
            assert chains[0].blamed is None

    loop.run(scenario())
