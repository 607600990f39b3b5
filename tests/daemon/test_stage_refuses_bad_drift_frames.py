"""A chain stage against a hostile previous stage's drift frames, over real p2pd nodes on loopback.

The receiver is the daemon's own stage (`ChainLoop`, stage 1 of 2 with compressed boundaries); the sender
opens the chain stream as a first stage does and speaks the frame protocol, naming θ rounds no honest
first stage would: of the round itself, unparseable, further back than any stage keeps, for a round far in
the future, twice in a round, after the round's activations. Each one breaks the chain at once, with a
warning that says why (no wait on the sender's word), θ and the saved state stay as they were, and the
next chain on the same node serves an honest first stage."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from pathlib import Path

import msgpack
import pytest
import torch

from hetnode.config import Config, replace
from hetnode.daemon.chain import ChainLoop
from hetnode.daemon.chain_links import ChainLayout
from hetnode.daemon.stage_training import KEPT_EMBEDDINGS, frame_limits
from hetnode.net import loop
from hetnode.net.identity import ephemeral_identity
from hetnode.net.node import SwarmNode
from hetnode.net.records import new_peer_record
from hetnode.net.streams import OpenStream, read_frame, write_frame
from hetnode.service.presence import Presence
from hetnode.wire.activation_frame import decode_frame, encode_drift, encode_frame

pytestmark = pytest.mark.slow

BROKEN_WITHIN_S = 20.0  # a refusal is at once: the chain loop ends this soon after the frame is sent
GRAD = object()  # a step of a script: read the gradient frame the stage answers with
FAR = 2**64 - 1  # the largest round msgpack carries


@pytest.fixture(scope="module")
def config(tiny_config: Config) -> Config:
    """tiny, with a heartbeat slower than the test: no chain records are published here, so the stage's
    member watch (which reads them every heartbeat) must not end the chain before the frames do."""
    return replace(tiny_config, "network", heartbeat_s=60.0, record_ttl_s=120.0, stable_heartbeat_s=60.0)


def altered_drift(change: Callable[[dict], None], round_: int = 0, base: int = -1) -> bytes:
    message = msgpack.unpackb(encode_drift(round_, base), raw=False)
    change(message)
    return msgpack.packb(message, use_bin_type=True)


def act(config: Config, round_: int, mb: int) -> bytes:
    """An honest-looking forward frame: subspace coefficients well inside the bounds, a token window."""
    generator = torch.Generator().manual_seed(mb)
    d = config.data
    shape = (d.batch_size, d.seq_len, config.pipeline.subspace_rank)
    coefficients = (torch.randn(shape, generator=generator) * 0.3).to(torch.bfloat16)
    window = torch.randint(0, config.model.vocab_size, (d.batch_size, d.seq_len + 1), generator=generator)
    return encode_frame("act", round_, mb, coefficients, window[:, :-1], window[:, 1:])


def scripts(config: Config) -> list[tuple[str, list, str]]:
    """(what, the sender's script, what the stage's reason for breaking the chain says)."""
    return [
        ("base of the round itself", [encode_drift(0, 0)], "base: the θ round of round 0's T_fix'"),
        ("base a string", [altered_drift(lambda m: m.update(base="x" * 10**5))], "characters)"),
        ("base missing", [altered_drift(lambda m: m.pop("base"))], "got None"),
        ("base below -1", [altered_drift(lambda m: m.update(base=-(2**63)))], "must be in [-1, 0)"),
        ("padded", [altered_drift(lambda m: m.update(data=b"\0" * 2**20))], "a drift frame carries"),
        ("base beyond the kept", [encode_drift(7, 6 - KEPT_EMBEDDINGS)], "rounds back"),
        ("far round", [encode_drift(FAR, FAR - 1), act(config, FAR, 0)], f"trains round {FAR}"),
        ("twice", [encode_drift(0, -1), encode_drift(0, -1)], "a second drift frame for round 0"),
        ("another round", [encode_drift(1, 0), act(config, 0, 0)], "named no θ round for round 0"),
        (
            "after activations",
            [encode_drift(0, -1), act(config, 0, 0), GRAD, encode_drift(0, -1)],
            "a second drift frame for round 0",
        ),
    ]


def stage(config: Config, node: SwarmNode, upstream: str, data_dir: Path) -> ChainLoop:
    """The last stage of a two-stage chain whose first stage is `upstream`; its coordinator sealed nothing."""
    n = config.model.n_layers
    layout = ChainLayout(
        "chain-x", 1, ((upstream,), (node.identity.peer_id,)), (range(0, n // 2), range(n // 2, n))
    )
    n_cfg = config.network
    presence = Presence(node, new_peer_record("edge", role="stage"), n_cfg.heartbeat_s, n_cfg.record_ttl_s)
    return ChainLoop(config, node, presence, ephemeral_identity().peer_id, layout, data_dir)


async def connect(sender: SwarmNode, receiver: str) -> OpenStream:
    """Open the chain stream as a first stage does, once the receiver's chain loop accepts it."""
    deadline = time.monotonic() + 60.0
    while True:
        stream = await sender.open_stage_stream(receiver)
        try:
            await read_frame(stream.reader, 0, timeout=5.0)  # the empty accept frame
            return stream
        except (TimeoutError, asyncio.IncompleteReadError, ConnectionError):
            stream.close()
        assert time.monotonic() < deadline, "the stage never accepted the chain stream"
        await asyncio.sleep(0.2)


async def play(stream: OpenStream, script: list, config: Config) -> list[torch.Tensor]:
    """Write the script's frames; at each GRAD read the stage's answer (a gradient of round 0)."""
    grads = []
    for step in script:
        if step is GRAD:
            data = await read_frame(stream.reader, 64 * 2**20, timeout=30.0)
            grads.append(decode_frame(data, frame_limits(config, True), "grad", expect_round=0).tensor)
        else:
            await write_frame(stream.writer, step, 10.0)
    return grads


def test_hostile_drift_frames_break_the_chain_at_once_and_an_honest_first_stage_is_served_after(
    nodes_on_loopback, config, tmp_path, caplog
):
    caplog.set_level(logging.WARNING, logger="hetnode.daemon.chain")

    async def scenario() -> None:
        async with nodes_on_loopback(2, "drift-test") as (receiver, sender):
            upstream, me = sender.identity.peer_id, receiver.identity.peer_id
            theta = None
            for what, script, expected in scripts(config):
                chain = stage(config, receiver, upstream, tmp_path)
                run = asyncio.create_task(chain.run(asyncio.Event()))
                stream = await connect(sender, me)
                held = chain.global_model.digests(), chain.global_model.params_round
                theta = theta or held
                assert held == theta, what  # the state saved by the chains before: θ as it was
                began = time.monotonic()
                grads = await play(stream, script, config)
                reason = await asyncio.wait_for(run, BROKEN_WITHIN_S)
                assert expected in reason, (what, reason)
                assert time.monotonic() - began < BROKEN_WITHIN_S, what
                assert len(reason) < 400, what  # a hostile value is quoted cut short
                assert all(g.isfinite().all() for g in grads), what
                assert (chain.global_model.digests(), chain.global_model.params_round) == theta, what
                stream.close()
                logged = [
                    r.getMessage() for r in caplog.records if "in-flight work dropped" in r.getMessage()
                ]
                assert logged and expected in logged[-1], what

            chain = stage(config, receiver, upstream, tmp_path)  # the next chain, on the same node
            stop = asyncio.Event()
            run = asyncio.create_task(chain.run(stop))
            stream = await connect(sender, me)
            honest = [encode_drift(0, -1), act(config, 0, 0), GRAD, act(config, 0, 1), GRAD]
            grads = await play(stream, honest, config)
            shape = (config.data.batch_size, config.data.seq_len, config.pipeline.subspace_rank)
            assert [tuple(g.shape) for g in grads] == [shape, shape]
            assert all(g.isfinite().all() and g.abs().max() > 0 for g in grads)
            assert chain.drift_base == (0, -1) and chain.training.drift_base == -1
            stop.set()
            assert await asyncio.wait_for(run, BROKEN_WITHIN_S) == "stopped"
            stream.close()

    loop.run(scenario())
