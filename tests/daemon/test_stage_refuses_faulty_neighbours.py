"""A chain stage against a faulty neighbour, over real p2pd nodes on loopback: both ends are the daemon's own
stage (`ChainLoop`, a chain of 2 with compressed boundaries), the faulty one handed its strategy as the peer
daemon hands it a `--fault` (`hetnode.daemon.faults`). A first stage whose activation frames carry a NaN or
a huge value, a last stage whose gradient frames carry a coefficient too many per token: the honest stage
refuses the first such frame, the chain breaks with a reason that names it (as the drift-frame harness,
`test_stage_refuses_bad_drift_frames.py`, does for hostile drift frames), and the honest stage's θ is as it
was."""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path

import pytest

from hetnode.config import Config, replace
from hetnode.daemon.chain import ChainLoop
from hetnode.daemon.chain_links import ChainLayout
from hetnode.daemon.faults.factory import faults_named
from hetnode.daemon.stage_training import stage_part
from hetnode.net import loop
from hetnode.net.identity import ephemeral_identity
from hetnode.net.node import SwarmNode
from hetnode.net.records import new_peer_record
from hetnode.replica.global_model import GlobalModel
from hetnode.service.presence import Presence

pytestmark = pytest.mark.slow

ENDED_WITHIN_S = 120.0  # start-up (θ, the data, the stream) and one micro-batch: seconds on tiny


@pytest.fixture(scope="module")
def config(tiny_config: Config) -> Config:
    """tiny, with a heartbeat slower than the test: no chain records are published here, so the stages'
    member watch (which reads them every heartbeat) must not end the chain before the frames do."""
    return replace(tiny_config, "network", heartbeat_s=60.0, record_ttl_s=120.0, stable_heartbeat_s=60.0)


def splits(config: Config) -> tuple[range, range]:
    n = config.model.n_layers
    return range(0, n // 2), range(n // 2, n)


def stage(
    config: Config, node: SwarmNode, index: int, members: tuple[str, str], data_dir: Path, fault: str | None
) -> ChainLoop:
    """Stage `index` of the chain `members`; its coordinator sealed nothing."""
    layout = ChainLayout("chain-x", index, tuple((m,) for m in members), splits(config))
    n_cfg = config.network
    record = new_peer_record(f"stage-{index}", role="stage")
    presence = Presence(node, record, n_cfg.heartbeat_s, n_cfg.record_ttl_s)
    coordinator = ephemeral_identity().peer_id
    data_dir.mkdir(parents=True, exist_ok=True)
    return ChainLoop(config, node, presence, coordinator, layout, data_dir, faults=faults_named(fault))


@pytest.mark.parametrize(
    ("fault", "faulty", "expected"),
    [
        ("act-nan", 0, "invalid activation frame from the previous stage: data: contains NaN or Inf"),
        ("act-huge", 0, "invalid activation frame from the previous stage: data: a value of magnitude 1e+30"),
        ("grad-shape", 1, "invalid gradient frame from the next stage: shape: expected (B, T, "),
    ],
    ids=["act-nan", "act-huge", "grad-shape"],
)
def test_an_honest_stage_refuses_a_faulty_neighbours_frames_and_keeps_its_theta(
    nodes_on_loopback, config, tmp_path, caplog, fault, faulty, expected
):
    caplog.set_level(logging.WARNING, logger="hetnode.daemon.chain")
    honest = 1 - faulty

    async def scenario() -> None:
        async with nodes_on_loopback(2, f"faults-{fault}") as nodes:
            members = (nodes[0].identity.peer_id, nodes[1].identity.peer_id)
            chains = [
                stage(config, node, i, members, tmp_path / f"stage-{i}", fault if i == faulty else None)
                for i, node in enumerate(nodes)
            ]
            runs = [asyncio.create_task(chain.run(asyncio.Event())) for chain in chains]
            reasons = await asyncio.wait_for(asyncio.gather(*runs), ENDED_WITHIN_S)
            assert expected in reasons[honest], reasons
            assert "stopped" not in reasons[faulty], reasons  # the chain is gone for both
            refuser = chains[honest].global_model
            theta0 = GlobalModel(config, part=stage_part(splits(config), honest, compressed=True))
            assert (refuser.params_round, refuser.digests()) == (-1, theta0.digests())
            logged = [r.getMessage() for r in caplog.records if "in-flight work dropped" in r.getMessage()]
            assert any(expected in line for line in logged), logged

    loop.run(scenario())
