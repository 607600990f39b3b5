"""The sealer on real p2pd nodes over loopback: who enters a seal, who is left out, and for how long."""

import asyncio
import time

import pytest

from bootstrap.verifier import MIN_SCORES, Replica, Verifier
from hetnode.config import replace
from hetnode.daemon.faults.factory import faults_named
from hetnode.daemon.rounds import AnchorTraining
from hetnode.data.dataset import TokenDataset
from hetnode.model.decoder import build_model
from hetnode.net import loop
from hetnode.net.node import SwarmNode
from hetnode.planning.rounds import Announcement, data_slot
from hetnode.protocol.sealing import BAN_S, RETRY_S, Sealer
from hetnode.replica.global_model import GlobalModel, base_fixed_embedding, sha256_hex

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def config(tiny_config):
    return replace(tiny_config, "outer", inner_steps=1)


@pytest.fixture(scope="module")
def dataset(config):
    return TokenDataset.build(config.data, config.model.vocab_size, config.run.seed)


async def announce(
    node: SwarmNode,
    config,
    dataset,
    model: GlobalModel,
    lie: bool = False,
    warmup: int = 0,
    fault: str | None = None,
    delay_s: float = 0.0,
) -> Announcement:
    """Train round 0 as `node`'s replica (after `warmup` earlier rounds, for a different payload), serve
    the payload (each after `delay_s`: a slow author within every stream timeout) and announce its
    digests (or wrong ones)."""
    peer = node.identity.peer_id
    training = AnchorTraining(config, dataset, peer, faults=faults_named(fault))
    for _ in range(warmup):
        training.run_round(0, model)
    payloads = training.run_round(0, model)

    def serve(round_, shard, replica, asker):
        return payloads.get(shard) if replica == peer else None

    async def slowly(round_, shard, replica, asker):
        await asyncio.sleep(delay_s)
        return serve(round_, shard, replica, asker)

    node.set_payloads(slowly if delay_s else serve)
    digests = {shard: sha256_hex((b"x" if lie else b"") + data) for shard, data in payloads.items()}
    record = {"round": 0, "shards": digests, "tokens": 100, "steps": 1}
    assert await node.store_own("announce", record, ttl_s=60.0)
    return Announcement(peer, 0, digests, 100, time.monotonic(), 1)


async def collect_all(sealer: Sealer, want: int) -> dict:
    seen: dict = {}
    deadline = time.monotonic() + 20
    while len(seen) < want and time.monotonic() < deadline:
        await sealer.collect(0, seen)
        await asyncio.sleep(0.2)
    assert len(seen) == want, seen
    return seen


def test_a_seal_holds_the_valid_reachable_authors_and_bans_only_the_invalid(
    config, dataset, nodes_on_loopback
):
    async def scenario():
        async with nodes_on_loopback(4, config.run.name) as nodes:
            sealer_node, honest, gone, liar = nodes
            model = GlobalModel(config)
            for node in (honest, gone, liar):
                await announce(node, config, dataset, model, lie=node is liar)
            await gone.shutdown()  # it left mid-round, after announcing
            sealer = Sealer(config, sealer_node, model)
            seen = await collect_all(sealer, 3)
            sealed = await sealer.seal(0, seen)
            now = time.monotonic()
            assert sealed is not None
            assert [peer for peer, _ in sealed.contributions] == [honest.identity.peer_id]
            assert set(sealed.excluded) == {gone.identity.peer_id, liar.identity.peer_id}
            assert sealer.banned[gone.identity.peer_id] - now <= RETRY_S  # back soon, not banned
            assert sealer.banned[liar.identity.peer_id] - now > RETRY_S
            assert sealer.banned[liar.identity.peer_id] - now <= BAN_S
            assert sealer.serve(0, "head", honest.identity.peer_id) is not None

    loop.run(scenario())


def test_a_round_with_nothing_valid_is_not_sealed_and_stays_open(config, dataset, nodes_on_loopback):
    async def scenario():
        async with nodes_on_loopback(3, config.run.name) as nodes:
            sealer_node, gone, liar = nodes
            model = GlobalModel(config)
            for node in (gone, liar):
                await announce(node, config, dataset, model, lie=node is liar)
            await gone.shutdown()
            sealer = Sealer(config, sealer_node, model)
            seen = await collect_all(sealer, 2)
            assert await sealer.seal(0, seen) is None  # an empty seal would move every replica's round
            assert seen == {}  # the round stays open for whoever announces next
            assert not (await sealer_node.read_field("seal"))

    loop.run(scenario())


def test_a_peer_that_re_announced_while_being_fetched_is_retried_not_banned(
    config, dataset, nodes_on_loopback
):
    async def scenario():
        async with nodes_on_loopback(2, config.run.name) as nodes:
            sealer_node, restarted = nodes
            model = GlobalModel(config)
            before = await announce(restarted, config, dataset, model)
            await announce(restarted, config, dataset, model, warmup=1)  # restarted: a new payload
            sealer = Sealer(config, sealer_node, model)
            # the sealer still holds the first announcement when it fetches: the payload differs from it
            assert await sealer.seal(0, {before.peer_id: before}) is None
            assert sealer.banned[restarted.identity.peer_id] - time.monotonic() < RETRY_S
            await asyncio.sleep(sealer.banned[restarted.identity.peer_id] - time.monotonic())
            sealed = await sealer.seal(0, await collect_all(sealer, 1))
            assert sealed is not None and sealed.contributions[0][0] == restarted.identity.peer_id

    loop.run(scenario())


def test_payloads_are_checked_as_announced_and_a_re_announcement_replaces_the_check(
    config, dataset, nodes_on_loopback
):
    async def scenario():
        async with nodes_on_loopback(3, config.run.name) as nodes:
            sealer_node, early, restarted = nodes
            model = GlobalModel(config)
            early_announcement = await announce(early, config, dataset, model)
            first = await announce(restarted, config, dataset, model)
            sealer = Sealer(config, sealer_node, model)
            seen = await collect_all(sealer, 2)
            # fetched and decoded as soon as seen: gone by the time the round is sealed, still in it
            deadline = time.monotonic() + 20
            while sealer.checks.checking() and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
            await early.shutdown()
            second = await announce(restarted, config, dataset, model, warmup=1)
            assert second.shards != first.shards
            while seen[restarted.identity.peer_id].shards != second.shards and time.monotonic() < deadline:
                await sealer.collect(0, seen)
                await asyncio.sleep(0.1)
            sealed = await sealer.seal(0, seen)
            assert sealed is not None and not sealed.excluded
            by_peer = {c["peer"]: c["shards"] for c in sealed.record["contributions"]}
            assert by_peer == {
                early.identity.peer_id: early_announcement.shards,
                restarted.identity.peer_id: second.shards,
            }

    loop.run(scenario())


def test_when_every_author_is_screened_out_only_work_that_helps_on_its_own_is_sealed(
    config, dataset, nodes_on_loopback
):
    """Both authors' score averages are negative (say the honest one's first rounds were weak): rather than
    stall, the seal takes the contribution that lowers the loss alone and still leaves out the harmful one."""

    async def scenario():
        async with nodes_on_loopback(3, config.run.name) as nodes:
            sealer_node, honest, flipper = nodes
            model = GlobalModel(config)
            await announce(honest, config, dataset, model)
            await announce(flipper, config, dataset, model, fault="signflip")
            decoder = build_model(config.model, seed=config.run.seed)
            decoder.fixed_embedding = base_fixed_embedding(config)
            verifier = Verifier(config, dataset, decoder)
            for node in (honest, flipper):
                verifier.averages[node.identity.peer_id] = -0.5
                verifier.counts[node.identity.peer_id] = MIN_SCORES
            asked = []

            async def rescue(round_, contributions, steps):
                asked.append(sorted(peer for peer, _ in contributions))
                replicas = {peer: Replica(peer, data_slot(peer)) for peer, _ in contributions}
                return await asyncio.to_thread(
                    verifier.helps, round_, model.params, contributions, replicas, steps
                )

            sealer = Sealer(config, sealer_node, model)
            sealer.screen, sealer.rescue = verifier.screen, rescue
            sealed = await sealer.seal(0, await collect_all(sealer, 2))
            assert asked == [sorted([honest.identity.peer_id, flipper.identity.peer_id])]
            assert sealed is not None
            assert [peer for peer, _ in sealed.contributions] == [honest.identity.peer_id]
            assert sealed.rejected == {flipper.identity.peer_id: "score"}

            # the harmful one alone: nothing is sealed, the round stays open
            sealer = Sealer(config, sealer_node, model)
            sealer.screen, sealer.rescue = verifier.screen, rescue
            alone = {flipper.identity.peer_id: (await collect_all(sealer, 2))[flipper.identity.peer_id]}
            assert await sealer.seal(0, alone) is None

    loop.run(scenario())


def test_a_slow_author_is_left_out_at_the_fetch_deadline_and_held_back_for_longer_each_time(
    config, dataset, nodes_on_loopback
):
    async def scenario():
        async with nodes_on_loopback(3, config.run.name) as nodes:
            sealer_node, honest, slow = nodes
            model = GlobalModel(config)
            await announce(honest, config, dataset, model)
            await announce(slow, config, dataset, model, delay_s=8.0)
            sealer = Sealer(config, sealer_node, model)
            sealer.fetch_deadline.floor_s = 1.0
            seen = await collect_all(sealer, 2)
            started = time.monotonic()
            sealed = await sealer.decide(0, seen)
            took = time.monotonic() - started
            assert sealed is not None
            assert [peer for peer, _ in sealed.contributions] == [honest.identity.peer_id]
            assert sealed.excluded == [slow.identity.peer_id]
            assert took < 6.0, took  # not the author's 8 s a payload, shard after shard
            held = sealer.banned[slow.identity.peer_id] - time.monotonic()
            assert 0 < held <= RETRY_S
            assert sealer.times_late[slow.identity.peer_id] == 1
            # late again: held back twice as long; once on time, forgiven
            sealer._hold_back_late(1, slow.identity.peer_id)
            assert sealer.banned[slow.identity.peer_id] - time.monotonic() > RETRY_S
            assert honest.identity.peer_id not in sealer.times_late
            # a held-back author is not waited for
            assert sealer.waiting_for({honest.identity.peer_id, slow.identity.peer_id}) == {
                honest.identity.peer_id
            }

    loop.run(scenario())


def test_a_stranger_announcing_first_does_not_start_the_rounds_clock(config, dataset, nodes_on_loopback):
    async def scenario():
        async with nodes_on_loopback(1, config.run.name) as nodes:
            sealer = Sealer(config, nodes[0], GlobalModel(config))
            sealer._sealed_recently.append(frozenset({"honest-a", "honest-b"}))
            now = time.monotonic()
            stranger = Announcement("stranger", 0, {}, 1, now - 20.0)  # ceiling: 30 s
            early = {"stranger": stranger}
            assert not sealer.ready({"honest-a", "honest-b"}, early)  # only the ceiling would end it
            seen = early | {"honest-a": Announcement("honest-a", 0, {}, 1, now)}
            assert not sealer.ready({"honest-a", "honest-b"}, seen)  # the clock started with honest-a
            seen["honest-b"] = Announcement("honest-b", 0, {}, 1, now)
            assert sealer.ready({"honest-a", "honest-b"}, seen)

    loop.run(scenario())
