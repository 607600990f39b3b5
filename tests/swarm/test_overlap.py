"""Overlapped rounds over real daemons (docs/sync.md, "Overlap"): anchors train round t+1 while round t syncs,
hold the coordinator's θ bit for bit, and a replica frozen past two seals rebases onto the downloaded θ."""

import pytest

from hetnode.service.round_log import read_rounds

pytestmark = pytest.mark.slow

OVERLAP = {"inner_steps": 10, "overlap": True}


def test_overlapped_anchors_train_ahead_agree_and_rebase_after_a_freeze(swarm):
    boot = swarm.bootstrap(swarm.config(outer=OVERLAP))
    boot.wait_ready()
    steady = swarm.join("steady", boot.maddr, "1000")
    flaky = swarm.join("flaky", boot.maddr, "1000")
    steady.wait_ready()
    flaky.wait_ready()
    swarm.wait_for_round(1, timeout=120)

    # frozen past two seals: on waking it downloads θ, settles the payload it had announced, and its
    # training thread rebases onto the downloaded θ and goes on as the swarm's next round
    frozen_at = swarm.freeze_past_seals(flaky)

    history = swarm.wait_for_history(
        lambda h: any(flaky.peer_id in e["contributors"] for e in h if e["round"] > frozen_at + 2),
        timeout=120,
        what="the woken anchor contributes again",
    )

    def both_hold(document: dict) -> bool:
        rounds = [p["params_round"] for p in document["peers"] if p["name"] in ("steady", "flaky")]
        return len(rounds) == 2 and all(r is not None and r > frozen_at + 2 for r in rounds)

    document = swarm.wait_for(boot.maddr, both_hold, timeout=60, what="both anchors past the freeze")
    swarm.agree_with_coordinator(document, {"steady", "flaky"})
    published = {p["name"]: p.get("utilization") for p in document["peers"]}
    assert published["steady"] is not None and 0 < published["steady"] <= 1, published  # in its record
    assert "layer digests differ" not in steady.tail(400)

    logged = {r["round"]: r for r in read_rounds(swarm.tmp_path / "steady")}
    assert logged and all(r["overlap"] for r in logged.values())
    ahead = [
        r
        for r, entry in logged.items()
        if r + 1 in logged and logged[r + 1]["started_at"] < entry["time"] + entry["seal_wait_s"]
    ]
    # round r+1 began before round r's seal was even seen, in (nearly) every round
    assert len(ahead) >= len(logged) - 2, logged
    evaluated = swarm.wait_for_round(history[-1]["round"], timeout=60, evaluated=True)
    losses = [e["eval_loss"] for e in evaluated if e.get("eval_loss") is not None]
    assert losses[-1] < losses[0], losses
