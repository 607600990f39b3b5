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


def test_a_pool_shares_the_micro_batches_and_the_chain_keeps_its_rounds_when_a_worker_dies(swarm):
    config = swarm.config(
        outer={"inner_steps": H, "verify": True},
        pipeline={"stages": 2, "stage_workers": 2},
    )
    boot = swarm.bootstrap(config)
    boot.wait_ready()
    anchor = swarm.join("anchor", boot.maddr, "1000")
    edges = [swarm.join(f"edge-{i}", boot.maddr, "20") for i in (1, 2, 3)]
    for daemon in [anchor, *edges]:
        daemon.wait_ready()
    by_id = {edge.peer_id: edge for edge in edges}
    document = swarm.wait_for(
        boot.maddr,
        lambda d: any(c["live"] and len(sum(c["workers"], [])) == 3 for c in d["chains"]),
        120,
        "a live chain of three: one first stage, a pool of two at the second",
    )
    [chain] = document["chains"]
    assert [len(w) for w in chain["workers"]] == [1, 2]  # the first stage takes no pool
    first = by_id[chain["workers"][0][0]]
    pool = [by_id[p] for p in chain["workers"][1]]
    everyone = {anchor.peer_id, first.peer_id, *(w.peer_id for w in pool)}
    history = swarm.wait_for_history(
        lambda h: sum(everyone <= set(e["contributors"]) for e in h) >= 2,
        300,
        "two rounds sealed with the anchor, the first stage and both workers of the pool",
    )

    # the micro-batches the first stage fed went to one worker of the pool or the other, never both
    deadline = time.monotonic() + 60  # a stage logs a round once the seal is applied
    while time.monotonic() < deadline:
        logs = [logged_rounds(swarm, d) for d in (first, *pool)]
        common = set(logs[0]) & set(logs[1]) & set(logs[2])
        if common:
            break
        time.sleep(0.5)
    assert common, "no round logged by the first stage and both workers"
    for r in common:
        fed, served = logs[0][r]["steps"], [logs[1][r]["steps"], logs[2][r]["steps"]]
        assert fed == H and sum(served) == H and min(served) > 0, (r, fed, served)
    # each worker's weight delay is the 1F1B bound of its stage, whatever the routing: τ_s = P−1−s
    assert max(r["max_weight_delay"] for r in logs[0].values()) == 1
    assert all(r["max_weight_delay"] == 0 for log in logs[1:] for r in log.values())
    for entry in history:
        if everyone <= set(entry["contributors"]):
            # the pool's two workers weigh together as one stage: their steps split the first stage's
            weights = entry["weights"]
            assert weights[pool[0].peer_id] + weights[pool[1].peer_id] <= 2 * weights[first.peer_id]

    # one worker of the pool dies mid-round (a few seconds into a round it trains): the chain keeps its
    # name, the micro-batches it held go to the other worker, and the round is sealed with the chain
    dead, alive = pool
    applied = dead.tail(400).count("applied")
    deadline = time.monotonic() + 60
    while dead.tail(400).count("applied") == applied and time.monotonic() < deadline:
        time.sleep(0.2)
    time.sleep(3.0)
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
    logs = first.tail(2000)
    assert "in-flight work dropped" not in logs  # the chain never broke
    assert f"lost {dead.peer_id[-8:]} of the next stage" in logs
    assert "goes to another worker" in logs
    swarm.replicas_agree_at(boot.maddr, history[-1]["round"], {"anchor", first.name, alive.name})
