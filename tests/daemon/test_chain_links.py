"""A stage's links to a pool of workers over real p2pd streams (`hetnode.daemon.chain_links.Neighbours`): a
micro-batch goes to a worker not tried this round, its frame is kept until its gradient is back, and when
the worker it went to is lost it goes to another worker of the pool; losing the last one breaks the chain."""

from __future__ import annotations

import asyncio

import pytest

from hetnode.daemon.chain_links import ChainBroken, ChainLayout, Neighbours
from hetnode.net import loop
from hetnode.net.streams import read_frame, write_frame

pytestmark = pytest.mark.slow


def test_a_lost_workers_micro_batches_go_to_another_and_the_last_loss_breaks_the_chain(nodes_on_loopback):
    async def scenario() -> None:
        async with nodes_on_loopback(3, "links") as (sender, *workers):
            ids = [node.identity.peer_id for node in (sender, *workers)]
            layout = ChainLayout("c1-x", 0, ((ids[0],), (ids[1], ids[2])), (range(0, 2), range(2, 4)))
            arrived: dict[str, asyncio.Queue] = {}
            holding = asyncio.Event()

            def acceptor_for(peer_id: str):
                arrived[peer_id] = asyncio.Queue()

                async def accept(peer, reader, writer):  # a worker that reads frames and never answers
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
