"""A leaving stage hands its error feedback to the spare that took its stage, over real p2pd nodes on
loopback: only that spare gets it, once; strangers claiming the chain's lineage or the stage are refused;
a predecessor that is gone or serves feedback too large to be honest costs the spare its feedback only."""

import asyncio
import time

import pytest
import torch

from hetnode.algo.sparseloco import MAX_FEEDBACK_RATIO, feedback_refusal
from hetnode.daemon.feedback_handoff import FeedbackHandoff, take_feedback
from hetnode.net import loop
from hetnode.net.streams import PeerRequestError
from hetnode.planning.roles import (
    Candidate,
    Claim,
    chain_id,
    chain_status,
    format_layout,
    pack_chains,
    plan_successors,
)
from hetnode.protocol.swarm_view import SwarmView

SHAPES = {"layers.2.w": (8, 4), "layers.2.b": (8,), "layers.3.w": (8, 4)}
SHARDS = {"2": ["layers.2.w", "layers.2.b"], "3": ["layers.3.w"]}


def _tensors(seed: int, scale: float) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {name: torch.randn(shape, generator=g) * scale for name, shape in SHAPES.items()}


def test_feedback_is_taken_only_for_our_tensors_and_within_the_bound():
    theta = _tensors(0, 1.0)
    assert feedback_refusal(_tensors(1, 0.01), theta) is None
    assert "not our stage's tensors" in feedback_refusal({"layers.2.w": theta["layers.2.w"]}, theta)
    assert "more than" in feedback_refusal(_tensors(1, 2 * MAX_FEEDBACK_RATIO), theta)
    nan = _tensors(1, 0.01)
    nan["layers.3.w"][0, 0] = float("nan")
    assert "more than" in feedback_refusal(nan, theta)  # a NaN never passes a bound


def _record(status_layout, chain, stage, first, last, lineage):
    return {
        "role": "stage",
        "chain": chain,
        "stage": stage,
        "layers": [first, last],
        "chain_layout": format_layout(status_layout),
        "chain_lineage": lineage,
        "chain_broken": None,
        "chain_blame": None,
        "chain_noshows": None,
    }


def _views(survivor: str, leaver: str, spare: str, strangers: tuple[str, str]):
    """The chain (survivor, leaver) of 2 stages × 2 layers, broken by the leaver; its successor with the
    spare at the leaver's stage; and two strangers' live chain under the same lineage (the leaver's stage
    claimed by one of them). Returns (the founding chain's plan, the view as the leaver reads it)."""
    [founded] = pack_chains([Candidate(survivor, 2.0), Candidate(leaver, 1.0)], 2, n_layers=4, boundary=5)
    assert founded.members == (survivor, leaver)
    broken = [Claim(survivor, founded.chain, 0, founded.stages[0].layers, founded.stages[0].layout, "", True)]
    [status] = chain_status(broken, 2, 4)
    [successor], _ = plan_successors([status], [Candidate(spare, 1.0)], 2, 4, boundary=6)
    assert successor.predecessors_of(spare) == (leaver,)
    peers = {
        s.peer_id: _record(s.layout, successor.chain, s.stage, *s.layers, founded.chain)
        for s in successor.stages
    }
    (f0, l0), (f1, l1) = (s.layers for s in founded.stages)
    fake = ((strangers[0], f0, l0), (strangers[1], f1, l1))
    fake_chain = chain_id(6, [(p, (f, la)) for p, f, la in fake], founded.chain)
    for stage, (peer, first, last) in enumerate(fake):
        peers[peer] = _record(fake, fake_chain, stage, first, last, founded.chain)
    view = SwarmView(peers, 2, 4)
    assert {c.chain for c in view.chains() if c.live} == {successor.chain, fake_chain}
    return founded, view


@pytest.mark.slow
def test_only_the_spare_that_took_the_stage_gets_its_feedback_once(nodes_on_loopback, tiny_config):
    async def scenario():
        async with nodes_on_loopback(6, "handoff-test") as nodes:
            survivor, leaver, spare, stranger, accomplice, gone = nodes
            ids = {n: n.identity.peer_id for n in nodes}
            await gone.shutdown()
            founded, view = _views(ids[survivor], ids[leaver], ids[spare], (ids[accomplice], ids[stranger]))

            async def read_view(max_age_s=None):
                return view

            theta = _tensors(0, 1.0)
            left = _tensors(1, 0.01)
            handoff = FeedbackHandoff(
                ids[leaver],
                1,
                founded.stages[1].layers,
                founded.members,
                founded.chain,
                left,
                SHARDS,
                7,
                read_view,
            )
            leaver.set_feedback(handoff)
            assert handoff.taker_problem(view, ids[stranger]) == "its chain holds none of our chain's members"
            assert handoff.taker_problem(view, ids[survivor]) == "not at stage 1"
            assert handoff.anyone_to_take(view)

            # the stranger at our stage of a live chain under our lineage is refused, and takes nothing
            assert await take_feedback(stranger, tiny_config, [ids[leaver]], SHARDS, theta) is None
            assert handoff.taker is None and not handoff.done.is_set()
            # a predecessor that is gone costs the spare a failed request, then it asks the next one
            started = time.monotonic()
            taken = await take_feedback(spare, tiny_config, [ids[gone], ids[leaver]], SHARDS, theta)
            assert time.monotonic() - started < 20
            assert taken is not None and taken[0] == ids[leaver]
            assert set(taken[1]) == set(SHAPES)
            assert all(torch.equal(taken[1][name], left[name]) for name in SHAPES)
            assert handoff.done.is_set() and handoff.taker == ids[spare]
            assert await handoff.wait(5.0, asyncio.Event()) == "taken"
            # once taken, nobody else gets it, the spare's stage-mate included
            assert await take_feedback(survivor, tiny_config, [ids[leaver]], SHARDS, theta) is None

            # a predecessor whose feedback is far larger than an honest residual is not taken from
            liar = FeedbackHandoff(
                ids[accomplice],
                1,
                founded.stages[1].layers,
                founded.members,
                founded.chain,
                _tensors(2, 5.0),
                SHARDS,
                7,
                read_view,
            )
            accomplice.set_feedback(liar)
            assert await take_feedback(spare, tiny_config, [ids[accomplice]], SHARDS, theta) is None
            assert liar.taker == ids[spare]  # it served: the spare refused what it got
            # served is not taken: only the taker's word ends a handoff (an exit could cut bytes in flight)
            assert not liar.done.is_set()
            with pytest.raises(PeerRequestError):
                await survivor.confirm_feedback(ids[accomplice])
            assert not liar.done.is_set()
            await spare.confirm_feedback(ids[accomplice])
            assert liar.done.is_set()

    loop.run(scenario())
