"""A chain trains with the anchors over the network: two stage processes run the asynchronous pipeline
over P2P streams, each syncs its own layers in the sealed rounds, and every replica holds the same θ."""

from __future__ import annotations

import ast

import pytest

pytestmark = pytest.mark.slow

FAST_ROUNDS = {"inner_steps": 10}
TOKENS_PER_REPLICA = 10 * 16 * 128  # H micro-batches x batch x sequence


def test_an_anchor_and_a_chain_of_two_train_one_model(swarm):
    boot = swarm.bootstrap(swarm.config(outer=FAST_ROUNDS))
    boot.wait_ready()
    anchor = swarm.join("anchor", boot.maddr, "1000")
    edges = [swarm.join(f"edge-{i}", boot.maddr, "20") for i in (1, 2)]
    for daemon in [anchor, *edges]:
        daemon.wait_ready()
    chain = {edge.peer_id for edge in edges}

    def with_chain(history: list[dict]) -> list[dict]:
        return [entry for entry in history if chain <= set(entry["contributors"])]

    history = swarm.wait_for_history(
        lambda h: len(with_chain(h)) >= 3, timeout=300, what="3 rounds sealed with the chain in them"
    )
    for entry in with_chain(history):
        assert anchor.peer_id in entry["contributors"]
        assert entry["tokens"] == 2 * TOKENS_PER_REPLICA  # the anchor and the chain, counted once each
    assert history[-1]["eval_loss"] < history[0]["eval_loss"] - 0.3, [e["eval_loss"] for e in history]

    logs = "".join(edge.tail(400) for edge in edges)
    assert "stage 0 of 2 connected" in logs and "stage 1 of 2 connected" in logs
    announced = {
        line.split("announcing shards ")[1] for line in logs.splitlines() if "announcing shards" in line
    }
    assert len(announced) == 2, announced  # each stage syncs its own layers, the same ones every round
    shards = [ast.literal_eval(text) for text in announced]
    assert sorted(shards[0] + shards[1]) == sorted(["embed", "0", "1", "2", "3", "head"])  # all, once
    assert "in-flight work dropped" not in logs  # the chain never broke

    def all_applied(document: dict) -> bool:
        newest = history[-1]["round"]
        return all(
            (p["params_round"] or -1) >= newest for p in document["peers"] if p["role"] in ("anchor", "stage")
        )

    document = swarm.wait_for(boot.maddr, all_applied, timeout=60, what="every replica applied the round")
    rounds = swarm.agree_with_coordinator(document, {"anchor", "edge-1", "edge-2"})
    assert set(rounds) == {"anchor", "edge-1", "edge-2"}
