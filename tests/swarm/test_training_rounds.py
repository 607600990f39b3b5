"""Anchors train one model over the network: sealed SparseLoCo rounds, identical digests, hostile payloads
excluded, a killed anchor left out of the seal and caught up after a restart (real processes, loopback)."""

from __future__ import annotations

import signal

import pytest

from hetnode.config import OuterConfig
from hetnode.net.identity import load_or_create_identity

pytestmark = pytest.mark.slow

FAST_ROUNDS = {"inner_steps": 10}
TOKENS_PER_ROUND = 10 * 16 * 128  # H inner steps x batch x sequence (tiny)


def test_anchors_train_together_with_identical_digests(swarm):
    boot = swarm.bootstrap(swarm.config(outer=FAST_ROUNDS))
    boot.wait_ready()
    # anchor-2 flips a bit of its θ after round 1 (a silent memory fault): the digest check must repair it
    anchors = [
        swarm.join("anchor-1", boot.maddr, "1000"),
        swarm.join("anchor-2", boot.maddr, "1000", extra=["--fault", "drift"]),
    ]
    for anchor in anchors:
        anchor.wait_ready()
    history = swarm.wait_for_round(5, timeout=240, evaluated=True)  # eval loss: beside the next seals
    # both anchors in each seal once both have a verified round (a late starter is on probation for one)
    assert all(len(entry["contributors"]) == 2 for entry in history[3:6]), history
    full = OuterConfig().probation_rounds
    for entry in history[:6]:  # H steps x batch x seq each, in proportion to the weight it earned
        assert set(entry["weights"]) == set(entry["contributors"])
        assert entry["tokens"] == sum(TOKENS_PER_ROUND * w // full for w in entry["weights"].values())
    assert max(history[5]["weights"].values()) > 1  # weight grows with verified rounds
    losses = [entry["eval_loss"] for entry in history]
    assert losses[3] < losses[0] - 0.3, losses  # the global model learns

    def both_applied(document: dict) -> bool:
        return all(
            p["params_round"] is not None and p["params_round"] >= 3
            for p in document["peers"]
            if p["name"].startswith("anchor")
        )

    document = swarm.wait_for(boot.maddr, both_applied, timeout=60, what="both anchors applied round 3")
    rounds = swarm.agree_with_coordinator(document, {"anchor-1", "anchor-2"})
    assert set(rounds) == {"anchor-1", "anchor-2"}

    faulty = anchors[1].tail(400)
    assert "fault injection: flipped one bit" in faulty
    assert "layer digests differ from the coordinator's" in faulty and "caught up" in faulty
    assert "layer digests differ" not in anchors[0].tail(400)  # an honest replica never mismatches
    assert swarm.metric(anchors[1], "hetnode_digest_mismatch_total") >= 1
    assert swarm.metric(anchors[0], "hetnode_digest_mismatch_total") == 0

    # no hub: the anchors fetch each other's payloads from their authors; the coordinator downloads each
    # once to validate it and serves only as the fallback (with a hub it would send what it receives)
    validated = swarm.metric(boot, 'hetnode_bytes_received_total{channel="sync"}')
    served = swarm.metric(boot, 'hetnode_bytes_sent_total{channel="sync"}')
    assert validated > 0 and served < 0.25 * validated, (served, validated)


def test_hostile_payloads_are_excluded_and_honest_replicas_agree(swarm):
    boot = swarm.bootstrap(swarm.config(outer=FAST_ROUNDS))
    boot.wait_ready()
    honest = [swarm.join(f"honest-{i}", boot.maddr, "1000") for i in (1, 2)]
    nan = swarm.join("sends-nan", boot.maddr, "1000", extra=["--fault", "nan"])
    liar = swarm.join("wrong-digest", boot.maddr, "1000", extra=["--fault", "digest"])
    for daemon in [*honest, nan, liar]:
        daemon.wait_ready()
    bad = {nan.peer_id, liar.peer_id}
    # a hostile peer that started late on a loaded machine may first announce after round 3: wait for both
    history = swarm.wait_for_history(
        lambda h: len(h) >= 4 and bad <= {p for e in h for p in e["excluded"]} and swarm.all_evaluated(h),
        timeout=240,
        what="four sealed rounds, with both hostile peers excluded from a seal",
    )
    excluded = {peer for entry in history for peer in entry["excluded"]}
    assert bad <= excluded, history
    for entry in history:
        assert not bad & set(entry["contributors"])
    assert {h.peer_id for h in honest} <= set(history[-1]["contributors"])
    assert history[-1]["eval_loss"] < history[0]["eval_loss"]
    assert "excluding peer" in boot.tail(200) and nan.peer_id in boot.tail(200)
    document = swarm.status(boot.maddr)
    swarm.agree_with_coordinator(document, {"honest-1", "honest-2"})
    # the ledger credits sealed contributions only: the excluded earn nothing
    standings = {s["peer"]: s for s in swarm.contributions(boot)["standings"]}
    assert not bad & set(standings)
    for daemon in honest:
        assert standings[daemon.peer_id]["rounds"] >= 1
        # each credited round: the schedule by the weight it had earned, w of F (at least 1, at most F)
        rounds, full = standings[daemon.peer_id]["rounds"], OuterConfig().probation_rounds
        assert rounds * (TOKENS_PER_ROUND // full) <= standings[daemon.peer_id]["tokens"]
        assert standings[daemon.peer_id]["tokens"] <= rounds * TOKENS_PER_ROUND


def test_a_killed_anchor_is_left_out_and_catches_up_after_restart(swarm, tmp_path):
    boot = swarm.bootstrap(swarm.config(outer=FAST_ROUNDS))
    boot.wait_ready()
    steady = swarm.join("steady", boot.maddr, "1000")
    flaky = swarm.join("flaky", boot.maddr, "1000")
    steady.wait_ready()
    flaky.wait_ready()
    swarm.wait_for_round(1, timeout=120)

    # frozen (a laptop asleep) while two rounds are sealed without it: on waking it is two rounds behind,
    # downloads θ, and asks the coordinator whether the payload it had announced made it into a seal
    swarm.freeze_past_seals(flaky)
    assert "is unknown" not in flaky.tail(200) and "cannot ask the coordinator" not in flaky.tail(200)

    flaky.proc.send_signal(signal.SIGKILL)
    flaky.proc.wait(10)
    killed_round = swarm.history()[-1]["round"]
    history = swarm.wait_for_round(killed_round + 2, timeout=120)
    assert history[-1]["contributors"] == [steady.peer_id]  # sealed without the dead anchor

    again = swarm.join("flaky", boot.maddr, "1000")  # same name, same data dir: same identity
    again.wait_ready()
    assert again.peer_id == flaky.peer_id

    def rejoined(document: dict) -> bool:
        peers = {p["name"]: p for p in document["peers"]}
        flaky_round = peers.get("flaky", {}).get("params_round")
        return flaky_round is not None and flaky_round > killed_round + 2

    document = swarm.wait_for(
        boot.maddr, rejoined, timeout=120, what="the restarted anchor applies a new round"
    )
    assert "caught up: holding θ after round" in again.tail(200)  # it downloaded θ, it did not start over
    rounds = swarm.agree_with_coordinator(document, {"steady", "flaky"})
    assert rounds["flaky"] > killed_round + 2
    later = swarm.wait_for_round(rounds["flaky"] + 3, timeout=120)
    assert any(flaky.peer_id in entry["contributors"] for entry in later[rounds["flaky"] + 1 :])


def test_anchor_restart_resumes_its_error_feedback_and_round(swarm, tmp_path):
    import torch

    boot = swarm.bootstrap(swarm.config(outer=FAST_ROUNDS))
    boot.wait_ready()
    anchor = swarm.join("solo", boot.maddr, "1000")
    anchor.wait_ready()
    swarm.wait_for(  # sealed is not yet applied: stop it once it holds round 2
        boot.maddr,
        lambda d: any(p["name"] == "solo" and (p["params_round"] or -1) >= 2 for p in d["peers"]),
        timeout=120,
        what="the anchor holds round 2",
    )
    assert anchor.stop() == 0  # SIGTERM: the only anchor, so no round is sealed while it is away
    [state_file] = (tmp_path / "solo").glob("anchor-state-*.pt")
    saved = torch.load(state_file, weights_only=True)
    saved_norm = sum(b.pow(2).sum() for b in saved["feedback"]["buffers"].values()) ** 0.5
    assert saved["params_round"] >= 2 and saved_norm > 0

    again = swarm.join("solo", boot.maddr, "1000")
    again.wait_ready()
    history = swarm.wait_for_round(saved["params_round"] + 1, timeout=120)
    log = again.tail(200)
    assert f"resumed local state: round {saved['params_round']}," in log
    assert f"error-feedback norm {float(saved_norm):.6f}" in log
    assert "caught up" not in log  # θ came from its own disk, not from the coordinator
    assert history[-1]["contributors"] == [again.peer_id]
    document = swarm.wait_for(
        boot.maddr,
        lambda d: any(
            p["name"] == "solo" and (p["params_round"] or -1) > saved["params_round"] for p in d["peers"]
        ),
        timeout=60,
        what="the resumed anchor applies the next round",
    )
    swarm.agree_with_coordinator(document, {"solo"})


def test_anchors_seal_while_the_coordinator_is_away_and_it_catches_up_on_return(swarm):
    """Stand-ins are the operator's choice (docs/security.md, "Who is trusted with what"): both anchors are
    listed in the manifest, so their
    keys are made before the coordinator starts."""
    ids = [load_or_create_identity(swarm.tmp_path / f"anchor-{i}" / "identity.key").peer_id for i in (1, 2)]
    stand_ins = [arg for peer in ids for arg in ("--stand-in", peer)]
    boot = swarm.bootstrap(swarm.config(outer=FAST_ROUNDS), extra=stand_ins)
    boot.wait_ready()
    anchors = [swarm.join(f"anchor-{i}", boot.maddr, "1000") for i in (1, 2)]
    for anchor in anchors:
        anchor.wait_ready()
    swarm.wait_for_round(1, timeout=120)
    boot.proc.send_signal(signal.SIGKILL)
    boot.proc.wait(10)
    sealed_before = swarm.history()
    last_by_coordinator = sealed_before[-1]["round"]
    stand_in = min(anchors, key=lambda d: d.peer_id)

    def moved_on(document: dict) -> bool:
        rounds = [p["params_round"] for p in document["peers"] if p["name"].startswith("anchor")]
        # rounds are synchronous: both anchors hold the same round most of the time
        return len(rounds) == 2 and rounds[0] == rounds[1] and (rounds[0] or -1) >= last_by_coordinator + 2

    document = swarm.wait_for(
        anchors[0].maddr, moved_on, timeout=150, what="rounds go on without the coordinator"
    )
    digests = [p["layer_digests"] for p in document["peers"] if p["name"].startswith("anchor")]
    assert digests[0] == digests[1]  # same round, bit-identical parameters, sealed by an anchor
    assert "sealing in its place" in stand_in.tail(300)
    other = next(d for d in anchors if d is not stand_in)
    assert "sealing in its place" not in other.tail(300)

    # the coordinator comes back (same data dir: same identity and address) with an older θ on disk
    again = swarm.bootstrap(swarm.tmp_path / "swarm.toml", extra=stand_ins)
    again.wait_ready()
    assert again.maddr == boot.maddr
    history = swarm.wait_for_history(
        lambda h: any(e["round"] > last_by_coordinator + 2 and len(e["contributors"]) == 2 for e in h),
        timeout=150,
        what="the restarted coordinator seals rounds with both anchors again",
    )
    # a stand-in may seal once more while the coordinator evaluates and checkpoints its first catch-up,
    # so it can catch up more than once; each time to a newer round, and then it seals again itself
    caught_up = [e["round"] for e in history if e.get("caught_up_from")]
    assert caught_up and caught_up[0] >= last_by_coordinator + 2  # it took the rounds sealed in its place
    assert caught_up == sorted(set(caught_up))
    assert any(e["round"] > caught_up[-1] and not e.get("caught_up_from") for e in history)
    swarm.replicas_agree_at(boot.maddr, history[-1]["round"], {"anchor-1", "anchor-2"})
    # the ledger survived kill -9: every credit written before it is still there
    standings = {s["peer"]: s for s in swarm.contributions(again)["standings"]}
    for anchor in anchors:
        before = sum(1 for e in sealed_before if anchor.peer_id in e["contributors"])
        assert standings[anchor.peer_id]["rounds"] >= before >= 1


def test_a_peer_joining_late_downloads_theta_and_matches_the_next_round(swarm):
    boot = swarm.bootstrap(swarm.config(outer=FAST_ROUNDS))
    boot.wait_ready()
    swarm.join("early", boot.maddr, "1000").wait_ready()
    swarm.wait_for_round(2, timeout=120)
    late = swarm.join("late", boot.maddr, "1000")
    late.wait_ready()
    history = swarm.wait_for_history(
        lambda h: any(late.peer_id in e["contributors"] for e in h), 120, "a round with the late peer in it"
    )
    joined_at = next(e["round"] for e in history if late.peer_id in e["contributors"])
    assert joined_at >= 3
    assert "caught up: holding θ after round" in late.tail(200)  # it did not train from θ⁰
    swarm.replicas_agree_at(boot.maddr, history[-1]["round"], {"early", "late"})
