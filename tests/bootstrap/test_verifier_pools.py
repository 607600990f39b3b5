"""The verifier with stage pools (a stage held by several workers, each training its own copy of the slice on
the micro-batches routed to it): a pooled chain is tried per combination of one worker a stage, so a
pool-mate's update is never dropped by another's, a harmful worker is caught without framing its
pool-mate or neighbours, and a chain without a pool is tried exactly as before."""

from __future__ import annotations

import pytest

from bootstrap.verifier import MAX_COMBINATIONS, Replica, Verifier, pool_combinations, replica_of
from hetnode.daemon.faults.factory import faults_named
from hetnode.daemon.rounds import AnchorTraining
from hetnode.planning.rounds import data_slot, shard_order
from hetnode.replica.global_model import GlobalModel

CHAIN = "c1-0"


@pytest.fixture(scope="module")
def setup(verifier_parts):
    config, dataset, model = verifier_parts
    theta = GlobalModel(config)
    trained = {}
    for peer, fault in (("honest-a", None), ("honest-b", None), ("honest-c", None), ("flip-x", "signflip")):
        payloads = AnchorTraining(config, dataset, peer, faults=faults_named(fault)).run_round(0, theta)
        trained[peer] = theta.decode_contribution(peer, 0, payloads)
    return config, dataset, model, theta, trained


def _part(decoded, shards):
    return [message for message in decoded if message.shard in shards]


def _stages(config):
    order = shard_order(config.model.n_layers)
    half = len(order) // 2
    return set(order[:half]), set(order[half:])


def _chain(setup, workers: dict[str, tuple[str, int]]):
    """A chain made of anchors' updates cut at the stage boundary: {peer: (whose update, stage)}."""
    config, _, _, _, trained = setup
    stages = _stages(config)
    contributions = [
        (peer, _part(trained[source], stages[stage])) for peer, (source, stage) in workers.items()
    ]
    record = {"role": "stage", "chain": CHAIN}
    replicas = {peer: replica_of(peer, record | {"stage": stage}) for peer, (_, stage) in workers.items()}
    return contributions, replicas


def test_combinations_try_every_worker_and_stay_bounded():
    assert pool_combinations([["a"], ["b"]]) == [("a", "b")]
    assert pool_combinations([["a1", "a2"], ["b"]]) == [("a1", "b"), ("a2", "b")]
    assert pool_combinations([["a1", "a2"], ["b1", "b2"]]) == [
        ("a1", "b1"),
        ("a1", "b2"),
        ("a2", "b1"),
        ("a2", "b2"),
    ]
    wide = [[f"a{i}" for i in range(5)], [f"b{i}" for i in range(4)]]  # 20 > the bound: round robin
    assert MAX_COMBINATIONS < 5 * 4
    combos = pool_combinations(wide)
    assert (
        len(combos) == 5 and {c[0] for c in combos} == set(wide[0]) and {c[1] for c in combos} == set(wide[1])
    )
    assert combos[4] == ("a4", "b0")


def test_a_stage_members_record_names_its_stage():
    record = {"role": "stage", "chain": CHAIN, "stage": 1}
    assert replica_of("p", record).stage == 1 and replica_of("p", record).key == CHAIN
    assert replica_of("p", record | {"stage": True}).stage is None  # not a number
    assert replica_of("p", {"role": "anchor", "stage": 1}) == Replica("p", data_slot("p"))


def test_a_chain_without_a_pool_is_one_trial_as_before(setup):
    config, dataset, model, theta, _ = setup
    contributions, replicas = _chain(setup, {"s1": ("honest-c", 1), "s0": ("honest-a", 0)})
    trial = Verifier(config, dataset, model)._trial(0, theta.params, contributions, replicas)
    assert list(trial.members) == [CHAIN] and trial.members[CHAIN] == ["s1", "s0"]  # contribution order
    assert trial.merged[CHAIN] == trial.updates["s1"] | trial.updates["s0"]
    # records without a stage (before pools): the same single trial
    bare = {peer: Replica(r.key, r.slot, r.lineage) for peer, r in replicas.items()}
    assert (
        Verifier(config, dataset, model)._trial(0, theta.params, contributions, bare).members == trial.members
    )


def test_each_pool_worker_is_tried_with_its_own_update(setup):
    config, dataset, model, theta, trained = setup
    workers = {"w-a": ("honest-a", 0), "w-b": ("flip-x", 0), "s1": ("honest-c", 1)}
    contributions, replicas = _chain(setup, workers)
    contributions.append(("honest-b", trained["honest-b"]))  # an anchor beside them
    replicas["honest-b"] = replica_of("honest-b", None)
    trial = Verifier(config, dataset, model)._trial(0, theta.params, contributions, replicas, {"w-a": 1})
    assert trial.members.pop("honest-b") == ["honest-b"]
    assert trial.members == {f"{CHAIN}#0": ["w-a", "s1"], f"{CHAIN}#1": ["w-b", "s1"]}
    # merged by replica, w-b's tensors would have replaced w-a's: each combination keeps its worker's
    assert trial.merged[f"{CHAIN}#0"] == trial.updates["w-a"] | trial.updates["s1"]
    assert trial.merged[f"{CHAIN}#1"] == trial.updates["w-b"] | trial.updates["s1"]
    # the chain trained the micro-batches its pool served between them (1 + H), within the cap
    assert trial.batches[CHAIN] == min(1 + config.outer.inner_steps, config.outer.step_cap)
    # the chain counts once in the round's medians, as the anchor does: each combination holds half
    assert trial.held["honest-b"] == 2 * trial.held[f"{CHAIN}#0"] == 2 * trial.held[f"{CHAIN}#1"]


def test_a_harmful_pool_worker_is_caught_and_frames_nobody(setup):
    config, dataset, model, theta, trained = setup
    workers = {"s0": ("honest-c", 0), "w-good": ("honest-a", 1), "w-flip": ("flip-x", 1)}
    contributions, replicas = _chain(setup, workers)
    # alone in a round (no yardstick yet): the combination with the good worker helps, the other does not
    # (merged by replica, the chain was one of the two, whichever came last: all three passed or none)
    verifier = Verifier(config, dataset, model)
    assert verifier.helps(0, theta.params, contributions, replicas) == {"w-good", "s0"}
    # scored beside an anchor: the flipped worker is negative, its pool-mate and neighbour are not
    anchor = ("honest-b", trained["honest-b"])
    replicas["honest-b"] = replica_of("honest-b", None)
    scores = verifier.score(0, theta.params, [anchor, *contributions], replicas)
    assert scores["w-flip"] < 0 < scores["honest-b"], scores
    assert scores["w-good"] > 0 and scores["s0"] > 0, scores
