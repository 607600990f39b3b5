"""A stage held by a pool of workers, over real daemons: the spare left over when the chain is packed joins
its second stage, the first stage routes each micro-batch to one of the pool's workers, each worker syncs
its own copy of the stage's layers, and the chain keeps its rounds when one of the pool dies."""

from __future__ import annotations

import signal
import time

import pytest

from hetnode.service.round_log import read_rounds

pytestmark = pytest.mark.slow

H = 10


def logged_rounds(swarm, daemon) -> dict[int, dict]:
    return {r["round"]: r for r in read_rounds(swarm.tmp_path / daemon.name) if r["included"]}


def start_chain_with_pool(swarm, pool_extra=()):
    """A coordinator, an anchor and a chain of two whose advertised compute makes the first peer the first
    stage; then a third stage peer, which the live chain takes into its second stage's pool at the next
    boundary (the first stage takes no pool), going on under its lineage."""
    # (no verifier: its scores of a pool's parts are tests/bootstrap/test_verifier_pools.py's; here the
    # routing, the chain's growth, a worker's death and a liar's blame are what is under test)
    config = swarm.config(
        outer={"inner_steps": H, "verify": False},
        pipeline={"stages": 2, "stage_workers": 2},
    )
    boot = swarm.bootstrap(config)
    boot.wait_ready()
    anchor = swarm.join("anchor", boot.maddr, "1000")
    first = swarm.join("edge-1", boot.maddr, "20", extra=["--tflops", "4"])
    second = swarm.join("edge-2", boot.maddr, "20", extra=["--tflops", "2"])
    for daemon in [anchor, first, second]:
        daemon.wait_ready()
    document = swarm.wait_for(boot.maddr, lambda d: any(c["live"] for c in d["chains"]), 120, "a chain")
    [founded] = [c for c in document["chains"] if c["live"]]
    spare = swarm.join("edge-3", boot.maddr, "20", extra=["--tflops", "1", *pool_extra])
    spare.wait_ready()
    document = swarm.wait_for(
        boot.maddr,
        lambda d: any(c["live"] and len(sum(c["workers"], [])) == 3 for c in d["chains"]),
        120,
        "the live chain takes the spare into its pool",
    )
    [chain] = [c for c in document["chains"] if c["live"]]
    assert chain["workers"][0] == [first.peer_id]
    assert sorted(chain["workers"][1]) == sorted([second.peer_id, spare.peer_id])
    assert chain["lineage"] == founded["id"] and chain["id"] != founded["id"]
    assert "resumed local state (θ, error feedback and optimiser)" in first.tail(400)
    return boot, anchor, first, [second, spare], chain


def test_a_pool_shares_the_micro_batches_and_the_chain_keeps_its_rounds_when_a_worker_dies(swarm):
    boot, anchor, first, pool, chain = start_chain_with_pool(swarm)
    everyone = {anchor.peer_id, first.peer_id, *(w.peer_id for w in pool)}
    swarm.wait_for_history(
        lambda h: sum(everyone <= set(e["contributors"]) for e in h) >= 2,
        300,
        "two rounds sealed with the anchor, the first stage and both workers of the pool",
    )

    # the micro-batches the first stage fed went to one worker of the pool or the other, both only when
    # asked for a second opinion (which the first stage counts)
    deadline = time.monotonic() + 60  # a stage logs a round once the seal is applied
    while time.monotonic() < deadline:
        logs = [logged_rounds(swarm, d) for d in (first, *pool)]
        common = set.intersection(*(set(log) for log in logs))
        if common:
            break
        time.sleep(0.5)
    assert common, "no round logged by the first stage and both workers"
    for r in common:
        fed, served = logs[0][r]["steps"], [log[r]["steps"] for log in logs[1:]]
        copies = logs[0][r]["second_opinions"]
        assert fed == H and sum(served) == H + copies and min(served) > 0, (r, fed, copies, served)
    # each worker's weight delay is the 1F1B bound of its stage, whatever the routing: τ_s = P−1−s
    assert max(r["max_weight_delay"] for r in logs[0].values()) == 1
    assert all(r["max_weight_delay"] == 0 for log in logs[1:] for r in log.values())

    # one worker of the pool dies mid-round (a second into a round it trains): the chain keeps its
    # name, any micro-batch it held goes to the other worker, and the round is sealed with the chain
    dead, alive = pool
    applied = dead.tail(400).count("applied")
    deadline = time.monotonic() + 60
    while dead.tail(400).count("applied") == applied and time.monotonic() < deadline:
        time.sleep(0.2)
    time.sleep(1.0)  # the first micro-batches of the next round are on their way
    # the growth may have stopped the chain's old stage under a neighbour's feet (it logs a drop then):
    # what counts is that the kill drops nothing
    drops_before = first.tail(100_000).count("in-flight work dropped")
    dead.proc.send_signal(signal.SIGKILL)
    dead.proc.wait(10)
    killed_at = swarm.history()[-1]["round"]
    survivors = {anchor.peer_id, first.peer_id, alive.peer_id}
    history = swarm.wait_for_history(
        lambda h: sum(survivors <= set(e["contributors"]) for e in h[killed_at + 1 :]) >= 2,
        240,
        "two rounds sealed with the first stage and the worker left",
    )
    assert all(dead.peer_id not in e["contributors"] for e in history[killed_at + 2 :])
    assert {first.peer_id, alive.peer_id} <= set(history[killed_at + 1]["contributors"])  # no round lost
    document = swarm.status(boot.maddr)
    [now] = [c for c in document["chains"] if c["live"]]
    assert now["id"] == chain["id"] and now["workers"] == [[first.peer_id], [alive.peer_id]]
    logs = first.tail(100_000)
    assert logs.count("in-flight work dropped") == drops_before  # the chain never broke
    assert f"lost {dead.peer_id[-8:]} of the next stage" in logs
    # (whether it held a micro-batch at that instant is chance: test_chain_links.py sends one on for sure)
    swarm.replicas_agree_at(boot.maddr, history[-1]["round"], {"anchor", first.name, alive.name})


def test_a_pool_worker_that_turns_to_lying_is_dropped_and_never_sealed_again(swarm):
    """The pool's spare sends honest gradients for a while, then every one ×1000 (valid frames, far inside
    the wire's bounds): the first stage's norm check against the pool's other worker catches its first
    such frame, blames it, and the chain goes on with the honest worker under the same name."""
    boot, anchor, first, pool, chain = start_chain_with_pool(
        swarm, pool_extra=["--fault", "grad-scaled", "--fault-after", "60"]
    )
    honest, liar = pool
    # the growth may have stopped the chain's old stage under a neighbour's feet (it logs a drop then):
    # what counts is that the liar's blame drops nothing
    drops_before = first.tail(100_000).count("in-flight work dropped")
    document = swarm.wait_for(
        boot.maddr, lambda d: liar.peer_id in d["chains"][0]["blamed"], 240, "the liar is caught"
    )
    caught_at = swarm.history()[-1]["round"]
    [now] = document["chains"]
    assert now["live"] and now["id"] == chain["id"]
    assert now["workers"] == [[first.peer_id], [honest.peer_id]]
    logs = first.tail(100_000)
    assert f"{liar.peer_id} sent what no honest stage sends" in logs and "off the" in logs
    assert logs.count("in-flight work dropped") == drops_before  # the chain never broke
    chain_peers = {first.peer_id, honest.peer_id}
    history = swarm.wait_for_history(
        lambda h: sum(chain_peers <= set(e["contributors"]) for e in h[caught_at + 1 :]) >= 2,
        240,
        "two rounds sealed with the honest chain after the liar was caught",
    )
    assert any(liar.peer_id in e["contributors"] for e in history[: caught_at + 1])  # honest at first
    assert all(liar.peer_id not in e["contributors"] for e in history[caught_at + 1 :])
    swarm.replicas_agree_at(boot.maddr, history[-1]["round"], {"anchor", first.name, honest.name})
