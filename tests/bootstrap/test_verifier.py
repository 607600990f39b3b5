"""The verifier in process, on real payloads: honest replicas pass and score positive; stale, copied,
free-riding, scaled, sign-flipped and noise contributions are left out or score negative; identities earn
weight only by verified rounds."""

from __future__ import annotations

import pytest

from bootstrap.verifier import DUPLICATE_FLOOR, Replica, Verifier, replica_of
from hetnode.algo.scoring import index_overlap
from hetnode.config import replace
from hetnode.daemon.faults.factory import faults_named
from hetnode.daemon.rounds import AnchorTraining
from hetnode.planning.rounds import data_slot
from hetnode.replica.global_model import GlobalModel
from hetnode.wire.sync_payload import decode_payload

HONEST = ["honest-a", "honest-b", "honest-c"]


@pytest.fixture(scope="module")
def setup(verifier_parts):
    return verifier_parts


def _decoded(global_model, peer, payloads):
    return global_model.decode_contribution(peer, global_model.params_round + 1, payloads)


def _round(config, dataset, global_model, peers, fault=None):
    return {
        peer: AnchorTraining(config, dataset, peer, faults=faults_named(fault)).run_round(
            global_model.params_round + 1, global_model
        )
        for peer in peers
    }


def test_honest_work_passes_and_each_fault_is_caught(setup):
    config, dataset, model = setup
    theta = GlobalModel(config)
    honest = _round(config, dataset, theta, HONEST)
    faults = {f"{kind}-x": kind for kind in ("noise", "signflip", "scaled", "freerider")}
    hostile = {p: _round(config, dataset, theta, [p], fault=kind)[p] for p, kind in faults.items()}
    # a copy: honest-a's payload re-labelled with the copier's name (same length: a byte-level swap)
    copy = {shard: data.replace(b"honest-a", b"copier-x") for shard, data in honest["honest-a"].items()}
    assert decode_payload(copy["head"], theta.sparse_specs["head"]).replica == "copier-x"
    contributions = [(p, _decoded(theta, p, honest[p])) for p in HONEST]
    sparse = {p: {n: v for m in d for n, v in m.sparse.items()} for p, d in contributions}
    overlaps = [index_overlap(sparse[a], sparse[b]) for a in HONEST for b in HONEST if a < b]
    assert max(overlaps) < DUPLICATE_FLOOR, overlaps  # honest replicas select different positions
    contributions.append(("copier-x", _decoded(theta, "copier-x", copy)))
    contributions += [(p, _decoded(theta, p, hostile[p])) for p in faults]
    verifier = Verifier(config, dataset, model)
    reasons = verifier.screen(0, contributions)
    assert reasons.get("copier-x") == "copy"
    # seen in a later read than its original: a copy; seen in the same read: no order, nobody is refused
    # for it (had the copier's id sorted first, the honest original would have been called the copy)
    seen = {p: 1.0 for p, _ in contributions}
    assert (
        Verifier(config, dataset, model).screen(0, contributions, seen | {"copier-x": 2.0})["copier-x"]
        == "copy"
    )
    # seen in the same read, copy first: one training, sealed under one of the two; the one with the
    # verified history keeps it, whatever the order
    copier_first = sorted(contributions, key=lambda c: c[0] != "copier-x")  # the copy ahead of its original
    tied_verifier = Verifier(config, dataset, model)
    tied_verifier.earned.observe("honest-a", 1.0)
    tied = tied_verifier.screen(0, copier_first, seen)
    assert tied.get("copier-x") == "copy" and "honest-a" not in tied
    assert reasons.get("scaled-x") == "norm" and reasons.get("freerider-x") == "norm"
    assert not set(HONEST) & set(reasons)

    replicas = {p: Replica(p, data_slot(p)) for p, _ in contributions}
    scorable = [(p, d) for p, d in contributions if reasons.get(p) != "copy"]
    scores = verifier.score(0, theta.params, scorable, replicas)
    for peer in HONEST:
        assert scores[peer] > 0, scores
    for peer in ("noise-x", "signflip-x", "freerider-x"):
        assert scores[peer] < 0, (peer, scores)
    # one round's score does not judge an average (a round on a few sequences is noisy), but earns weight
    # only where it is not negative: the honest weigh 1 now, the harmful are still on probation
    assert {p: verifier.earned.weight(p) for p in HONEST} == dict.fromkeys(HONEST, 1)
    once = verifier.screen(0, contributions)
    assert once.get("noise-x") == "probation" and once.get("signflip-x") == "probation"
    # a second score judges the average: negative ones are screened out for it; honest ones are not
    verifier.score(0, theta.params, scorable, replicas)
    again = verifier.screen(0, contributions)
    assert again.get("noise-x") == "score" and again.get("signflip-x") == "score"
    assert not set(HONEST) & set(again)
    assert all(verifier.averages[p] > 0 for p in HONEST)
    assert verifier.weights(HONEST) == dict.fromkeys(HONEST, 2)
    # with nobody else left, work is sealed only if it would score non-negative against the last yardstick
    alone = [(p, d) for p, d in scorable if p in ("honest-b", "noise-x", "signflip-x")]
    assert verifier.helps(0, theta.params, alone, replicas) == {"honest-b"}
    verdicts = {v.peer: v for v in verifier.verdicts(0, HONEST, reasons, scores)}
    assert all(verdicts[p].reason is None for p in HONEST)
    assert verdicts["copier-x"].reason == "copy" and verdicts["copier-x"].score is None


def test_stale_work_is_named_by_its_header(setup):
    """Round 6 is sealed; one peer says it trained from θ after round 2 (honest about being late)."""
    config, dataset, model = setup
    theta = GlobalModel(config)
    payloads = _round(config, dataset, theta, ["late", "fresh"])
    decoded = {p: theta.decode_contribution(p, 0, payloads[p]) for p in payloads}

    def as_round_6(messages, base):
        return [type(m)(m.replica, 6, m.shard, m.codec, m.sparse, m.dense, base) for m in messages]

    contributions = [("late", as_round_6(decoded["late"], 2)), ("fresh", as_round_6(decoded["fresh"], 5))]
    assert Verifier(config, dataset, model).screen(6, contributions) == {"late": "stale"}


def test_a_chain_is_one_replica():
    stage = {"role": "stage", "chain": "c5-0"}
    assert replica_of("p1", stage) == replica_of("p2", stage) == Replica("c5-0", data_slot("c5-0"), "c5-0")
    assert replica_of("anchor", {"role": "anchor", "chain": None}).key == "anchor"
    # a chain that went on with a spare trains, and is scored, on its lineage's data
    successor = {"role": "stage", "chain": "c9-1", "chain_lineage": "c5-0"}
    replica = replica_of("p3", successor)
    assert replica.key == "c9-1" and replica.slot == data_slot("c5-0") and replica.batches_of == "c5-0"


def test_large_swarms_are_scored_in_a_secret_draw_no_one_can_predict(setup):
    """Beyond `verify_sample` replicas each is scored with chance max(verify_sample · w / W,
    verify_min_chance) for its share of the weight (equal weights: verify_sample / R), drawn anew every
    round from the coordinator's secret: being scored in round r says nothing about r+1 (before, the least
    recently scored went first: a replica scored in r knew it was safe in r+1)."""
    config, dataset, model = setup
    config = replace(config, "outer", verify_sample=2, verify_min_chance=0.25)
    keys = [f"replica-{i}" for i in range(5)]
    verifier = Verifier(config, dataset, model)
    rounds = 2000
    drawn = [set(verifier._sample(r, keys)) for r in range(rounds)]
    chance = 2 / 5
    for key in keys:
        scored = [key in d for d in drawn]
        assert abs(sum(scored) / rounds - chance) < 0.05, key
        after_scored = [b for a, b in zip(scored, scored[1:], strict=False) if a]
        assert abs(sum(after_scored) / len(after_scored) - chance) < 0.07, key  # r tells nothing of r+1
    # another coordinator life (another secret) draws otherwise
    other_life = Verifier(config, dataset, model)
    assert [set(other_life._sample(r, keys)) for r in range(50)] != drawn[:50]
    # the floor: with many replicas, each still has at least verify_min_chance every round
    many = [f"replica-{i}" for i in range(100)]
    share = sum(len(verifier._sample(r, many)) for r in range(200)) / (200 * len(many))
    assert abs(share - 0.25) < 0.03
    # scrutiny follows influence: one identity holding 8 of 12 weight units is scored every round, the
    # others at the floor; the cost stays about verify_sample a round
    heavy = dict.fromkeys(keys, 1) | {"replica-0": 8}
    drawn = [set(verifier._sample(r, keys, heavy)) for r in range(400)]
    assert all("replica-0" in d for d in drawn)
    assert abs(sum(len(d) - 1 for d in drawn) / (400 * 4) - 0.25) < 0.05

    theta = GlobalModel(config)
    newcomer = "replica-new"
    payloads = _round(config, dataset, theta, [*keys, newcomer])
    contributions = [(p, _decoded(theta, p, payloads[p])) for p in [*keys, newcomer]]
    replicas = {p: Replica(p, data_slot(p)) for p, _ in contributions}
    for key in keys:  # replicas with a record; the newcomer has none
        verifier.earned.observe(key, 1.0)
    scores = verifier.score(0, theta.params, contributions, replicas)
    # only the drawn are scored; a newcomer (on probation) from a budget of its own, so that it can
    # leave probation however large the swarm
    assert set(scores) == set(verifier._sample(0, keys)) | {newcomer}
    assert all(verifier.counts.get(p, 0) == (p in scores) for p in keys)
