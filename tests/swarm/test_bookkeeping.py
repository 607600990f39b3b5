"""The coordinator's bookkeeping beside the seal, over real processes on loopback: with every evaluation made
slow by a test hook (`tests/swarm/coordinator_hooks.py`), the coordinator goes on sealing while an earlier
round is still being evaluated; killed (SIGKILL, by the same hook) at the last instant before a seal goes
out, its history holds the digests of every round it published; and the coordinator restarted on its data
dir takes θ of its newest published round back from the replicas against those digests, seals the round it
never published again, credits the rounds it never evaluated, and seals on, within 60 s of its restart, while
two identities claim to hold that θ and answer as slowly as the timeouts allow."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
SLOW_EVAL_S = 20.0  # each evaluation, on top of its own time: several rounds are sealed meanwhile
HOOKS = ROOT / "tests" / "swarm" / "coordinator_hooks.py"
FAST_ROUNDS = {"inner_steps": 5}


def test_seals_go_on_while_a_round_is_evaluated_and_a_crash_before_a_seal_goes_out_recovers(swarm, tmp_path):
    config = swarm.config(outer=FAST_ROUNDS)
    crash = tmp_path / "crash-now"
    boot = swarm.bootstrap(config, command=[sys.executable, str(HOOKS), str(SLOW_EVAL_S), str(crash)])
    boot.wait_ready()
    anchors = [swarm.join(f"anchor-{i}", boot.maddr, "1000") for i in (1, 2)]
    for anchor in anchors:
        anchor.wait_ready()

    # round 0's evaluation takes 20 s; the coordinator seals the next rounds meanwhile
    history = swarm.wait_for_history(
        lambda h: len(h) >= 3 and not h[0].get("evaluated"), 240, "three rounds sealed, round 0 not evaluated"
    )
    assert all(e["layer_digests"] and e["seal_hash"] for e in history)  # digests at the seal, not after
    assert swarm.metric(boot, "hetnode_bookkeeping_lag_rounds") >= 2
    history = swarm.wait_for_history(lambda h: h[0].get("evaluated"), 120, "round 0 evaluated")
    assert history[1]["time"] < history[0]["evaluated_at"]  # round 1 was sealed before 0 was evaluated
    assert history[0]["eval_loss"] > 0 and set(history[0]["scores"]) == {a.peer_id for a in anchors}

    # identities that claim θ of every newest round and answer a catch-up as slowly as the timeouts allow
    liars = [
        swarm.start_attack("liar_holder", 240, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        for _ in range(2)
    ]
    try:
        crash_and_recover(swarm, config, boot, crash, anchors)
    finally:
        for liar in liars:
            liar.terminate()
            liar.wait(30)


def crash_and_recover(swarm, config, boot, crash, anchors) -> None:
    # SIGKILL at the next seal, between its line on disk and its store, while the rounds before it wait for
    # their evaluation: every round a replica can have applied has its digests in the history
    time.sleep(5)  # the liars' records are out
    crash.touch()
    boot.proc.wait(30)
    assert "crash before storing the seal" in boot.tail(5)
    before = swarm.history()
    unevaluated = [e for e in before if e.get("evaluated") is False]
    assert unevaluated and unevaluated[-1] is before[-1], [(e["round"], e.get("evaluated")) for e in before]
    unpublished, published = before[-1], before[-2]
    assert published["round"] == unpublished["round"] - 1
    assert published["layer_digests"] and set(published["credits"]) == set(published["contributors"])

    # back on its data dir, with no stand-in: θ of the newest published round from the replicas, checked
    # against its digests; the round never published is sealed again
    restarted_at = time.time()
    again = swarm.bootstrap(config)
    again.wait_ready()
    history = swarm.wait_for_history(
        lambda h: any(e["round"] > unpublished["round"] and len(e["contributors"]) == 2 for e in h),
        180,
        "the restarted coordinator seals rounds with both anchors again",
    )
    caught_up = [e for e in history if e["round"] == published["round"] and e.get("caught_up_from")]
    assert caught_up and caught_up[0]["caught_up_from"] in {a.peer_id for a in anchors}, history[-3:]
    # sealing again within 60 s of the restart, however slowly the liars answer
    first_seal = min(e["time"] for e in history if e["round"] > published["round"] and e["contributors"])
    assert first_seal - restarted_at <= 60.0, first_seal - restarted_at
    resealed = [e for e in history if e["round"] == unpublished["round"]]
    assert len(resealed) == 2 and resealed[-1]["seal_hash"] != unpublished["seal_hash"], resealed
    assert f"round {published['round']}: credited after a restart" in again.tail(400)
    swarm.replicas_agree_at(again.maddr, history[-1]["round"], {"anchor-1", "anchor-2"})
    standings = {s["peer"]: s for s in swarm.contributions(again)["standings"]}
    for anchor in anchors:  # every round sealed before the kill is credited, evaluated or not
        sealed_in = sum(1 for e in before if anchor.peer_id in e["contributors"])
        assert standings[anchor.peer_id]["rounds"] >= sealed_in >= 3
