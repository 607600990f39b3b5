"""The coordinator's bookkeeping beside the seal, over real processes on loopback: with every evaluation made
slow by a test hook (`tests/swarm/slow_bookkeeping.py`), the coordinator goes on sealing while an earlier
round is still being evaluated; a kill -9 right after a seal leaves that round's seal line in the history,
digests included; and the coordinator restarted on its data dir takes that round's θ back from the
replicas against those digests, credits the rounds it never evaluated, and seals on."""

from __future__ import annotations

import signal
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
SLOW_EVAL_S = 20.0  # each evaluation, on top of its own time: several rounds are sealed meanwhile
SLOW = [sys.executable, str(ROOT / "tests" / "swarm" / "slow_bookkeeping.py"), str(SLOW_EVAL_S)]
FAST_ROUNDS = {"inner_steps": 5}


def test_seals_go_on_while_a_round_is_evaluated_and_a_crash_after_a_seal_keeps_its_digests(swarm):
    config = swarm.config(outer=FAST_ROUNDS)
    boot = swarm.bootstrap(config, command=SLOW)
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

    # kill -9 while the newest rounds wait for their evaluation: their seal lines hold the digests
    boot.proc.send_signal(signal.SIGKILL)
    boot.proc.wait(10)
    before = swarm.history()
    unevaluated = [e for e in before if e.get("evaluated") is False]
    assert unevaluated and unevaluated[-1] is before[-1], [(e["round"], e.get("evaluated")) for e in before]
    last = before[-1]
    assert last["layer_digests"] and set(last["credits"]) == set(last["contributors"])

    # back on its data dir, with no stand-in: the round's θ from the replicas, checked against those digests
    again = swarm.bootstrap(config)
    again.wait_ready()
    history = swarm.wait_for_history(
        lambda h: any(e["round"] > last["round"] and len(e["contributors"]) == 2 for e in h),
        180,
        "the restarted coordinator seals rounds with both anchors again",
    )
    assert any(e["round"] == last["round"] and e.get("caught_up_from") for e in history), history[-3:]
    assert f"round {last['round']}: credited after a restart" in again.tail(400)
    swarm.replicas_agree_at(again.maddr, history[-1]["round"], {"anchor-1", "anchor-2"})
    standings = {s["peer"]: s for s in swarm.contributions(again)["standings"]}
    for anchor in anchors:  # every round sealed before the kill is credited, evaluated or not
        sealed_in = sum(1 for e in before if anchor.peer_id in e["contributors"])
        assert standings[anchor.peer_id]["rounds"] >= sealed_in >= 3
