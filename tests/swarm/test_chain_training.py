"""A chain trains with the anchors over the network: two stage processes run the asynchronous pipeline
over P2P streams, each syncs its own layers in the sealed rounds, and every replica holds the same θ."""

from __future__ import annotations

import ast
import re
import signal
import time

import pytest

from hetnode.config import OuterConfig
from hetnode.service.round_log import read_rounds

pytestmark = pytest.mark.slow

FAST_ROUNDS = {"inner_steps": 10}
TOKENS_PER_REPLICA = 10 * 16 * 128  # H micro-batches x batch x sequence


def start_anchor_and_chain(
    swarm,
    stages: int = 2,
    max_in_flight: int = 0,
    overlap: bool = False,
    schedule: str = "steps",
    verify: bool = True,
):
    outer = {**FAST_ROUNDS, "overlap": overlap, "schedule": schedule, "verify": verify}
    config = swarm.config(outer=outer, pipeline={"stages": stages, "max_in_flight": max_in_flight})
    boot = swarm.bootstrap(config)
    boot.wait_ready()
    anchor = swarm.join("anchor", boot.maddr, "1000")
    edges = [swarm.join(f"edge-{i}", boot.maddr, "20") for i in range(1, stages + 1)]
    for daemon in [anchor, *edges]:
        daemon.wait_ready()
    return boot, anchor, edges


def test_an_anchor_and_a_chain_of_two_train_one_model(swarm):
    boot, anchor, edges = start_anchor_and_chain(swarm)
    chain = {edge.peer_id for edge in edges}

    def with_chain(history: list[dict]) -> list[dict]:
        return [entry for entry in history if chain <= set(entry["contributors"])]

    history = swarm.wait_for_history(
        lambda h: len(with_chain(h)) >= 3 and swarm.all_evaluated(h),
        timeout=300,
        what="3 rounds sealed with the chain in them, and evaluated",
    )
    full = OuterConfig().probation_rounds
    for entry in with_chain(history):
        assert anchor.peer_id in entry["contributors"]
        # the anchor and the chain, at most once each, by the weight each earned (w of F)
        assert 0 < entry["tokens"] <= 2 * TOKENS_PER_REPLICA
        weight = entry["weights"][anchor.peer_id]
        assert entry["credits"][anchor.peer_id]["tokens"] == TOKENS_PER_REPLICA * weight // full
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

    swarm.replicas_agree_at(boot.maddr, history[-1]["round"], {"anchor", "edge-1", "edge-2"})

    # each daemon's round log: where time and bytes went (what the network benchmark reads)
    for edge in edges:
        logged = [r for r in read_rounds(swarm.tmp_path / edge.name) if r["included"]]
        assert logged and all(r["role"] == "stage" and r["tokens"] == TOKENS_PER_REPLICA for r in logged)
        assert all(r["activation_bytes_sent"] > 0 and r["upload_bytes"] > 0 for r in logged)
        # a stage fetches the others' payloads for its layers from the sealer, within its apply time
        assert all(r["download_bytes"] > 0 and 0 < r["fetch_s"] <= r["apply_s"] for r in logged)
    anchor_rounds = {r["round"]: r for r in read_rounds(swarm.tmp_path / "anchor")}
    anchor_round = next(iter(anchor_rounds.values()))
    assert anchor_round["role"] == "anchor" and anchor_round["tokens_per_s"] > 0
    # a stage holds and fetches only its layers: in a round sealed with the whole chain in it (a seal may
    # leave a late stage out) it downloads about half of what the anchor fetches (the chain's payload)
    whole_chain = {entry["round"] for entry in with_chain(history)}
    compared = 0
    for edge in edges:
        for r in read_rounds(swarm.tmp_path / edge.name):
            theirs = anchor_rounds.get(r["round"])
            if r["round"] in whole_chain and theirs and theirs["download_bytes"]:
                assert r["download_bytes"] < 0.75 * theirs["download_bytes"], (r, theirs)
                compared += 1
    assert compared, "no round with the whole chain sealed that the anchor fetched"
    assert anchor_round["max_weight_delay"] is None  # an anchor has no pipeline
    assert weight_delays(swarm, edges) == [1, 0]  # 1F1B: τ_s = P−1−s


def stage_of(swarm, edge) -> int:
    line = next(line for line in edge.tail(400).splitlines() if "connected (layers" in line)
    return int(line.split(": stage ")[1].split(" of ")[0])


def weight_delays(swarm, edges) -> list[int]:
    """The max weight delay each stage logged over its rounds, in stage order (checking the means)."""
    by_stage = {}
    for edge in edges:
        logged = read_rounds(swarm.tmp_path / edge.name)
        assert logged and all(0 <= r["mean_weight_delay"] <= r["max_weight_delay"] for r in logged)
        by_stage[stage_of(swarm, edge)] = max(r["max_weight_delay"] for r in logged)
    return [by_stage[s] for s in sorted(by_stage)]


def test_an_overlapped_paced_chain_of_three_runs_1f1b_and_trains_each_round_while_the_last_syncs(swarm):
    """Paced too (`outer.schedule = "paced"`): the first stage feeds the micro-batches that fit the round's
    budget and ends the round with their count, which every stage trains, announces and is sealed with."""
    # the pipeline's mechanics, not the verifier's view of the chain's work: under `selective` a chain's round
    # helps θ about a tenth of an anchor's once θ has trained a little (`hetnode bench chain-score`), and a
    # run under load that left it out by its score 95 rounds running never saw the 3 rounds this test needs
    boot, anchor, edges = start_anchor_and_chain(
        swarm, stages=3, overlap=True, schedule="paced", verify=False
    )
    chain = {edge.peer_id for edge in edges}
    history = swarm.wait_for_history(
        lambda h: sum(chain <= set(e["contributors"]) for e in h) >= 3, 300, "3 rounds with the chain"
    )
    H, cap = FAST_ROUNDS["inner_steps"], 2 * FAST_ROUNDS["inner_steps"]
    with_chain = [e for e in history if chain <= set(e["contributors"])]
    for entry in with_chain:  # every stage of a round counted the same micro-batches, within floor and cap
        counts = {entry["steps"][peer] for peer in chain}
        assert len(counts) == 1 and 1 <= counts.pop() <= cap, entry
    assert any(e["budget_s"] for e in history)
    logged = [{r["round"]: r["steps"] for r in read_rounds(swarm.tmp_path / e.name)} for e in edges]
    shared = set(logged[0]) & set(logged[1]) & set(logged[2])
    assert shared and all(len({log[r] for log in logged}) == 1 for r in shared), logged
    assert all(1 <= log[r] <= cap for log in logged for r in log) and H
    logs = "".join(edge.tail(400) for edge in edges)
    assert all(f"stage {s} of 3 connected" in logs for s in range(3))
    assert "in-flight work dropped" not in logs, [line for line in logs.splitlines() if " WARN" in line]
    # stage s keeps 3 − s micro-batches unanswered: weights 2, 1 and 0 updates old once the pipeline is full
    assert weight_delays(swarm, edges) == [2, 1, 0]
    swarm.replicas_agree_at(boot.maddr, history[-1]["round"], {"anchor", *(e.name for e in edges)})

    def ahead(edge) -> tuple[list[int], dict]:
        """The rounds r after which `edge` began round r+1 before it had even seen round r's seal."""
        logged = {r["round"]: r for r in read_rounds(swarm.tmp_path / edge.name)}
        assert logged and all(r["overlap"] for r in logged.values())
        early = [
            r
            for r, entry in logged.items()
            if r + 1 in logged and logged[r + 1]["started_at"] < entry["time"] + entry["seal_wait_s"]
        ]
        return early, logged

    # every stage, twice: a round whose seal came at once has nothing to overlap, so wait for the rounds
    deadline = time.monotonic() + 120
    for edge in edges:
        while len(ahead(edge)[0]) < 2 and time.monotonic() < deadline:
            time.sleep(1.0)
        assert len(ahead(edge)[0]) >= 2, (edge.name, ahead(edge)[1])


def sealed_with(peers: set[str]):
    return lambda entry: peers <= set(entry["contributors"])


def test_the_chain_goes_on_when_the_anchor_dies_and_the_anchor_catches_up(swarm):
    boot, anchor, edges = start_anchor_and_chain(swarm)
    chain = {edge.peer_id for edge in edges}
    swarm.wait_for_history(
        lambda h: any(sealed_with(chain | {anchor.peer_id})(e) for e in h), 240, "a round with everyone in it"
    )
    anchor.proc.send_signal(signal.SIGKILL)  # mid-round: it trains almost all the time
    anchor.proc.wait(10)
    killed_at = swarm.history()[-1]["round"]
    history = swarm.wait_for_history(
        lambda h: sum(e["contributors"] and set(e["contributors"]) == chain for e in h[killed_at + 1 :]) >= 2,
        240,
        "two rounds sealed by the chain alone",
    )
    assert all(anchor.peer_id not in e["contributors"] for e in history[killed_at + 2 :])

    again = swarm.join("anchor", boot.maddr, "1000")  # same data dir: same identity, its own local state
    again.wait_ready()
    rejoined_at = swarm.history()[-1]["round"]
    history = swarm.wait_for_history(
        lambda h: any(sealed_with(chain | {again.peer_id})(e) for e in h[rejoined_at + 1 :]),
        240,
        "a round with the restarted anchor and the chain",
    )
    swarm.replicas_agree_at(boot.maddr, history[-1]["round"], {"anchor", "edge-1", "edge-2"})


def test_a_spare_steps_in_for_a_member_that_left_and_without_one_the_chain_dissolves(swarm):
    """A chain outlives a member: the survivor keeps its stage and local state, the idle spare takes the
    empty stage at the next boundary, and the chain keeps its lineage (its data slot), though strangers
    claim the lineage for chains of their own and a fast "spare" never steps in (`attacker.py
    successor`). A spare that is stopped hands its stage's error feedback to the next spare, which adds
    it to its own. Once no spare is left, a chain that loses a member is left out of the seals and
    dissolves."""
    # (a wider in-flight window than the schedule's, to hide latency: its extra staleness is logged; every
    # replica constrained: under `selective` the verifier scores a chain's late rounds out, docs/chains.md
    # "What a chain's round is worth to θ", and the survivor and the spare would then never be sealed
    # together once the step-in took a few rounds more on a loaded machine)
    config = swarm.config(
        outer={**FAST_ROUNDS, "verify": True},
        pipeline={"stages": 2, "max_in_flight": 4, "compression": "everything"},
        network={"boundary_s": 6.0, "confirm_s": 3.0},
    )
    boot = swarm.bootstrap(config)
    boot.wait_ready()
    anchor = swarm.join("anchor", boot.maddr, "1000")
    edges = {name: swarm.join(name, boot.maddr, "20") for name in ("edge-1", "edge-2", "edge-3")}
    for daemon in [anchor, *edges.values()]:
        daemon.wait_ready()
    by_id = {edge.peer_id: edge for edge in edges.values()}
    document = swarm.wait_for(boot.maddr, lambda d: any(c["live"] for c in d["chains"]), 120, "a live chain")
    [founded] = document["chains"]
    first, second = (by_id[p] for p in founded["stages"])
    [spare] = [edge for edge in edges.values() if edge not in (first, second)]
    swarm.wait_for_history(
        lambda h: any(sealed_with({first.peer_id, second.peer_id})(e) for e in h),
        240,
        "a round with the chain",
    )
    assert founded["lineage"] == founded["id"]
    deadline = time.monotonic() + 60  # a stage logs its round once it applied the seal: after the seal
    while (
        not all(read_rounds(swarm.tmp_path / e.name) for e in (first, second)) and time.monotonic() < deadline
    ):
        time.sleep(0.5)
    delays = weight_delays(swarm, [first, second])
    assert 1 < delays[0] <= 3 and delays[1] == 0  # up to W − 1 = 3 updates old on the first stage, not P − 1

    # strangers claim the chain's lineage for chains of their own (a live one, and a newer one said broken),
    # and one says it is an idle spare far faster than anyone and never steps in
    attacker = swarm.start_attack("successor", 60)
    try:
        swarm.wait_for(
            boot.maddr,
            lambda d: any(
                c["live"] and c["lineage"] == founded["id"] and c["id"] != founded["id"] for c in d["chains"]
            ),
            timeout=60,
            what="the strangers' live chain under the chain's lineage",
        )
    except BaseException:
        attacker.kill()
        raise
    # the second stage dies: the first keeps its stage, the spare takes the empty one, same lineage
    second.proc.send_signal(signal.SIGKILL)
    second.proc.wait(10)
    killed_at = swarm.history()[-1]["round"]

    def continued(document: dict) -> bool:
        return any(
            c["live"] and c["lineage"] == founded["id"] and c["stages"] == [first.peer_id, spare.peer_id]
            for c in document["chains"]
        )

    document = swarm.wait_for(boot.maddr, continued, timeout=90, what="the spare steps in")
    fourth = swarm.join("edge-4", boot.maddr, "20")  # idle beside the chain: the next spare
    ours = [first.peer_id, spare.peer_id]
    successor = next(c for c in document["chains"] if c["live"] and c["stages"] == ours)
    assert successor["id"] != founded["id"]
    history = swarm.wait_for_history(
        lambda h: any(sealed_with({first.peer_id, spare.peer_id})(e) for e in h[killed_at + 1 :]),
        240,
        "a round sealed with the survivor and the spare",
    )
    logs = first.tail(400)
    assert f"goes on as {successor['id']}" in logs and "in-flight work dropped" in logs
    # the survivor's stage resumed its slice of θ, error feedback and optimiser from its local state
    assert "resumed local state (θ, error feedback and optimiser)" in logs
    assert "stage 1 of 2 connected" in spare.tail(400)
    # the dead member's partial work is never sealed (the round after `killed_at` may hold its whole round:
    # under overlap its payload can be out before the kill and sealed after it)
    for entry in history[killed_at + 2 :]:
        assert second.peer_id not in entry["contributors"]
    swarm.replicas_agree_at(boot.maddr, history[-1]["round"], {"anchor", first.name, spare.name})
    result = swarm.attack_result(
        attacker, timeout=120
    )  # its claims lasted past the step-in: it ends by itself
    assert result["lineage"] == founded["id"] and result["claims_stored"] > 0
    # the plan's first spare was the fast liar; passed over once the survivor named it
    assert f"{result['noshow'][-6:]} did not step in" in logs

    # the spare is stopped: it says it is offline and hands its stage's error feedback to the next spare
    fourth.wait_ready()
    spare.proc.send_signal(signal.SIGTERM)
    swarm.wait_for(
        boot.maddr,
        lambda d: any(
            c["live"] and c["lineage"] == founded["id"] and c["stages"] == [first.peer_id, fourth.peer_id]
            for c in d["chains"]
        ),
        timeout=90,
        what="the next spare steps in for the stopped one",
    )
    assert spare.proc.wait(60) == 0  # it left once its feedback was taken, long before its window ended
    handed = re.findall(r"handed error feedback \(norm ([0-9.]+)\) to (\w+)", spare.tail(100))
    assert handed, f"no handoff:\n{spare.tail(20)}\n--- {fourth.name}\n{fourth.tail(30)}"
    [handed] = handed
    assert handed[1] == fourth.peer_id[-8:] and float(handed[0]) > 0
    taken_from = re.findall(r"took our stage's error feedback from (\w+) \(norm ([0-9.]+),", fourth.tail(200))
    assert taken_from == [(spare.peer_id[-8:], handed[0])]  # all of it, bit for bit in its norm
    # and trains its rounds (whether they are sealed is the verifier's score: this chain's late rounds score
    # low, docs/chains.md "What a chain's round is worth to θ"; the step-in's seal is checked above)
    deadline = time.monotonic() + 60
    while "stage 1 trained" not in fourth.tail(50) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert "stage 1 trained" in fourth.tail(50)

    # no spare left: the chain that loses its second stage is left out, and its survivor goes back to the pool
    fourth.proc.send_signal(signal.SIGKILL)
    fourth.proc.wait(10)
    killed_at = swarm.history()[-1]["round"]
    history = swarm.wait_for_history(
        lambda h: len(h) > killed_at + 3, 240, "three rounds after the stage died"
    )
    for entry in history[killed_at + 2 :]:
        assert entry["contributors"] == [anchor.peer_id]  # the chain's partial work never enters a seal

    def dissolved(document: dict) -> bool:
        survivor = next((p for p in document["peers"] if p["name"] == first.name), None)
        return survivor is not None and survivor["role"] == "idle" and not document["chains"]

    document = swarm.wait_for(boot.maddr, dissolved, timeout=60, what="the survivor is back in the pool")
    swarm.agree_with_coordinator(document, {"anchor", first.name})


def test_a_stage_that_lies_to_its_neighbour_is_blamed_and_the_chain_goes_on_without_it(swarm):
    """A stage whose every frame carries a NaN (what no honest stage sends) breaks its chain at the first
    frame; the receiver blames it in its record, and the chain goes on with a spare in its place, never
    with the liar: its work never enters a seal."""
    # every replica constrained: under `selective` a chain's update helps θ a tenth of an anchor's late in
    # training and the verifier leaves it out (docs/chains.md, "What a chain's round is worth to θ"), which
    # a chain formed late in this run, its first member long busy with the liar, would be
    config = swarm.config(
        outer={**FAST_ROUNDS, "verify": True},
        pipeline={"stages": 2, "compression": "everything"},
    )
    boot = swarm.bootstrap(config)
    boot.wait_ready()
    anchor = swarm.join("anchor", boot.maddr, "1000")
    liar = swarm.join("liar", boot.maddr, "20", extra=["--fault", "frames-nan"])
    first = swarm.join("edge-1", boot.maddr, "20")
    for daemon in [anchor, liar, first]:
        daemon.wait_ready()
    # the liar's chain lives a moment each boundary, between its first frame and the break: read the log
    deadline = time.monotonic() + 120
    while "sent what no honest stage sends" not in first.tail(400):
        assert time.monotonic() < deadline, f"no chain with the liar in 120 s:\n{first.tail(40)}"
        time.sleep(0.5)
    second = swarm.join("edge-2", boot.maddr, "20")
    second.wait_ready()
    honest = {first.peer_id, second.peer_id}

    def chain_without_liar(document: dict) -> bool:
        return any(c["live"] and set(c["stages"]) == honest for c in document["chains"])

    swarm.wait_for(boot.maddr, chain_without_liar, timeout=120, what="a live chain of the two honest stages")
    history = swarm.wait_for_history(
        lambda h: any(sealed_with(honest)(e) for e in h), 240, "a round sealed with the honest chain"
    )
    assert all(liar.peer_id not in e["contributors"] for e in history)
    caught = first.tail(2000)
    assert f"{liar.peer_id} sent what no honest stage sends" in caught and "NaN or Inf" in caught
    assert "sent what no honest stage sends" not in liar.tail(2000)  # it never caught an honest one
    swarm.replicas_agree_at(boot.maddr, history[-1]["round"], {"anchor", "edge-1", "edge-2"})
