"""Big models are built off the event loop: while an anchor or the coordinator's round keeper builds θ (for
1b, float64 draws of ~35 s each), the loop keeps running, so heartbeats and handlers go on; and a start-up
step that may take that long keeps the record alive meanwhile (`Presence.beating`). Real p2pd nodes."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable
from typing import TypeVar

import pytest
import torch

from bootstrap.ledger import Ledger
from bootstrap.round_keeper import RoundKeeper
from hetnode.config import Config, replace
from hetnode.daemon.anchor import AnchorLoop
from hetnode.net import loop
from hetnode.net.node import SwarmNode
from hetnode.net.records import new_peer_record
from hetnode.replica.global_model import GlobalModel
from hetnode.service.datadir import DataDir
from hetnode.service.presence import Presence

pytestmark = pytest.mark.slow

T = TypeVar("T")
TICK_S = 0.01


@pytest.fixture(scope="module")
def config(tiny_config: Config) -> Config:
    """A model whose seeded initialisation takes a measurable while on CPU (~26M parameters)."""
    return replace(tiny_config, "model", d_model=512, n_layers=8, n_heads=8, ffn_hidden=1408)


@pytest.fixture(scope="module")
def build_s(config: Config) -> float:
    """How long building θ blocks whatever thread builds it: the stall the loop would see."""
    began = time.monotonic()
    GlobalModel(config)
    return time.monotonic() - began


async def longest_stall(work: Awaitable[T]) -> tuple[T, float]:
    """`work`'s result, and the most the loop was late for a TICK_S sleep while it ran."""
    stall, running = 0.0, True

    async def ticker() -> None:
        nonlocal stall
        while running:
            before = time.monotonic()
            await asyncio.sleep(TICK_S)
            stall = max(stall, time.monotonic() - before - TICK_S)

    ticks = asyncio.create_task(ticker())
    await asyncio.sleep(0)  # the ticker is waiting before the work starts: a blocking start shows too
    try:
        result = await work
    finally:
        running = False
        await ticks
    return result, stall


def _presence(node: SwarmNode, heartbeat_s: float = 1.0) -> Presence:
    return Presence(node, new_peer_record("p", role="anchor"), heartbeat_s, 4 * heartbeat_s)


def test_an_anchor_builds_theta_and_its_replica_off_the_loop(nodes_on_loopback, config, build_s, tmp_path):
    assert build_s > 0.1, "the model must take a measurable while to build"

    async def scenario() -> None:
        async with nodes_on_loopback(1, "build-anchor") as (node,):
            anchor = AnchorLoop(config, node, _presence(node), "coordinator", "cpu", tmp_path / "state.pt")
            training, stall = await longest_stall(anchor._build())
            assert stall < build_s / 2, (stall, build_s)  # built on the loop, it would stall build_s
            assert anchor.global_model.params_round == -1
            assert anchor.rounds.global_model is anchor.global_model
            theta = anchor.global_model.params  # the replica starts from the same seeded weights
            assert all(torch.equal(p, theta[n]) for n, p in training.model.named_parameters())

    loop.run(scenario())


def test_the_round_keeper_builds_theta_off_the_loop(nodes_on_loopback, config, build_s, tmp_path):
    async def scenario() -> None:
        async with nodes_on_loopback(1, "build-keeper") as (node,):
            with DataDir(tmp_path / "coordinator") as data_dir, Ledger(data_dir.path / "ledger.db") as ledger:
                work = RoundKeeper.create(config, node, _presence(node), data_dir, ledger)
                keeper, stall = await longest_stall(work)
                assert stall < build_s / 2, (stall, build_s)
                assert keeper.global_model.params_round == -1
                assert keeper.sealer.global_model is keeper.global_model

    loop.run(scenario())


def test_start_up_work_keeps_the_record_alive(nodes_on_loopback):
    async def scenario() -> None:
        async with nodes_on_loopback(1, "build-beat") as (node,):
            presence = _presence(node, heartbeat_s=0.2)
            assert await presence.publish()
            first = presence.record["last_seen"]
            assert await presence.beating(asyncio.sleep(1.0, result="built")) == "built"
            assert presence.record["last_seen"] > first + 0.5  # stored again while the work ran
            await asyncio.sleep(0.5)
            quiet = presence.record["last_seen"]
            await asyncio.sleep(0.5)
            assert presence.record["last_seen"] == quiet  # and the start-up heartbeat ended with it

    loop.run(scenario())
