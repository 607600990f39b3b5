"""A stage's links to a pool of workers over real p2pd streams (`hetnode.daemon.chain_links.Neighbours`): a
micro-batch goes to a worker not tried this round, its frame is kept until its gradient is back, and when
the worker it went to is lost it goes to another worker of the pool; losing the last one breaks the chain."""

from __future__ import annotations

import asyncio

import pytest
import torch

from hetnode.daemon.chain_links import ChainBroken, ChainLayout, Neighbours
from hetnode.net import loop
from hetnode.net.streams import read_frame, write_frame

pytestmark = pytest.mark.slow


def silent_workers(workers, holding: asyncio.Event) -> dict[str, asyncio.Queue]:
    """Each worker's node takes a link and reads frames into its queue, never answering."""
    arrived: dict[str, asyncio.Queue] = {}

    def acceptor_for(peer_id: str):
        arrived[peer_id] = asyncio.Queue()

        async def accept(peer, reader, writer):
            await write_frame(writer, b"", 5.0)
            while True:
                try:
                    arrived[peer_id].put_nowait(await read_frame(reader, 2**20, timeout=None))
                except (asyncio.IncompleteReadError, ConnectionError):
                    await holding.wait()  # keep the handler (and the stream) as it is
                    return

        return accept

    for node in workers:
        node.set_stage_acceptor(acceptor_for(node.identity.peer_id))
    return arrived


def test_a_lost_workers_micro_batches_go_to_another_and_the_last_loss_breaks_the_chain(nodes_on_loopback):
    async def scenario() -> None:
        async with nodes_on_loopback(3, "links") as (sender, *workers):
            ids = [node.identity.peer_id for node in (sender, *workers)]
            layout = ChainLayout("c1-x", 0, ((ids[0],), (ids[1], ids[2])), (range(0, 2), range(2, 4)))
            holding = asyncio.Event()
            arrived = silent_workers(workers, holding)
            blamed = []

            async def on_blame(peer, why):
                blamed.append(peer)

            links = Neighbours(sender, layout, lambda: 100.0, on_blame)
            await links.connect({*ids}, asyncio.Event())
            assert set(links.downs) == {ids[1], ids[2]}
            links.new_round()
            await links.route(7, b"frame-7")
            await links.route(8, b"frame-8")
            first, second = links.routed[7].link, links.routed[8].link
            assert first is not second  # each worker is tried once a round before any gets a second
            got = {first.peer: await arrived[first.peer].get(), second.peer: await arrived[second.peer].get()}
            assert got == {first.peer: b"frame-7", second.peer: b"frame-8"}

            # the worker holding micro-batch 7 is lost: its frame goes to the other, byte for byte
            await links.lose(first, "gone", blame=True)
            assert blamed == [first.peer] and links.routed[7].link is second
            assert await asyncio.wait_for(arrived[second.peer].get(), 10) == b"frame-7"
            assert second.served == 2 and links.live(links.downs) == [second]
            back = links.answered(8)
            assert back.frame == b"frame-8" and 8 not in links.routed
            # the last worker of the next stage lost: the chain breaks, with the reason
            with pytest.raises(ChainBroken, match="gone too"):
                await links.lose(second, "gone too")
            links.close()
            holding.set()

    loop.run(scenario())


def test_a_copy_for_a_second_opinion_goes_to_the_other_worker_and_answers_for_it_once_the_first_is_lost(
    nodes_on_loopback,
):
    """Every micro-batch asked twice (`audit_share` 1): the same frame goes to both workers, the copy
    counted on its link and in the round's copies; the routed worker lost, the copy out there becomes the
    micro-batch's route (the worker would get it twice if it were sent again), and the opinion is void."""

    async def scenario() -> None:
        async with nodes_on_loopback(3, "copies") as (sender, *workers):
            ids = [node.identity.peer_id for node in (sender, *workers)]
            layout = ChainLayout("c1-x", 0, ((ids[0],), (ids[1], ids[2])), (range(0, 2), range(2, 4)))
            holding = asyncio.Event()
            arrived = silent_workers(workers, holding)

            async def on_blame(peer, why):
                raise AssertionError(f"nobody lied, {peer} blamed: {why}")

            links = Neighbours(sender, layout, lambda: 100.0, on_blame, audit_share=1.0, step_cap=10)
            await links.connect({*ids}, asyncio.Event())
            links.new_round()
            await links.route(7, b"frame-7")
            routed = links.routed[7].link
            [copy] = [link for link in links.live(links.downs) if link is not routed]
            assert links.audits[7].asked == [routed.peer, copy.peer] and links.copies == 1
            for link in (routed, copy):
                assert await asyncio.wait_for(arrived[link.peer].get(), 10) == b"frame-7"
                assert link.served == 1  # its end frame counts the copy
            assert links.is_copy(7, copy) and not links.is_copy(7, routed)

            await links.lose(routed, "gone")
            assert links.routed[7].link is copy and 7 not in links.audits
            assert arrived[copy.peer].empty() and copy.served == 1  # not sent again
            assert not links.is_copy(7, copy)  # its answer is the micro-batch's now
            # one worker left: nothing is asked twice
            await links.route(8, b"frame-8")
            assert 8 not in links.audits and links.copies == 1
            links.close()
            holding.set()

    loop.run(scenario())


def test_a_copys_gradient_already_back_answers_its_micro_batch_when_the_routed_worker_is_lost(
    nodes_on_loopback,
):
    """Of three workers, micro-batch 7 routed to one and copied to another, whose gradient is back (held by
    the opinion): the routed worker lost, that gradient answers the micro-batch (`on_spare_answer`), and
    the frame goes to nobody again (the copy's worker would count it twice against its round's cap)."""

    async def scenario() -> None:
        async with nodes_on_loopback(4, "spare-answers") as (sender, *workers):
            ids = [node.identity.peer_id for node in (sender, *workers)]
            layout = ChainLayout("c1-x", 0, ((ids[0],), tuple(ids[1:])), (range(0, 2), range(2, 4)))
            holding = asyncio.Event()
            arrived = silent_workers(workers, holding)

            async def on_blame(peer, why):
                raise AssertionError(f"nobody lied, {peer} blamed: {why}")

            answers = []
            links = Neighbours(sender, layout, lambda: 100.0, on_blame, audit_share=1.0, step_cap=10)
            links.on_spare_answer = lambda mb, link, grad: answers.append((mb, link.peer, grad))
            await links.connect({*ids}, asyncio.Event())
            links.new_round()
            await links.route(7, b"frame-7")
            routed = links.routed[7].link
            [copy_peer] = links.audits[7].waiting[1:]
            gradient = torch.ones(2, 3)
            links.audits[7].grads[copy_peer] = gradient  # the copy's answer, as `_second_opinion` keeps it
            await links.lose(routed, "gone")
            assert len(answers) == 1 and answers[0][:2] == (7, copy_peer) and answers[0][2] is gradient
            assert links.routed[7].link is links.downs[copy_peer] and not links.routed[7].timed
            assert 7 not in links.audits
            await asyncio.sleep(0.5)
            third = next(p for p in ids[1:] if p not in (routed.peer, copy_peer))
            assert arrived[third].empty() and arrived[copy_peer].qsize() == 1  # sent again to nobody
            assert sum(link.served for link in links.live(links.downs)) == 1
            links.close()
            holding.set()

    loop.run(scenario())
