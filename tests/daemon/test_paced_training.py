"""Paced rounds in process: an anchor trains as many steps as its round's budget allows (within the floor
and the cap), on the batches its steps name, at the swarm's point of the schedule, or sits the round out;
the verifier judges a slow honest replica and a fast one per step, so neither is screened out for its pace."""

from __future__ import annotations

import threading
import time

import pytest

from bootstrap.verifier import Replica, Verifier
from hetnode.algo.scoring import steps_shown
from hetnode.config import replace
from hetnode.daemon.rounds import AnchorTraining
from hetnode.data.dataset import TokenDataset
from hetnode.model.decoder import build_model
from hetnode.planning.rounds import data_slot, floor_seconds
from hetnode.protocol.seal_weights import STEPS_SLACK, verified_steps
from hetnode.replica.global_model import GlobalModel, base_fixed_embedding
from hetnode.training.local_rounds import RebaseInbox
from hetnode.training.schedule import schedule_position


@pytest.fixture(scope="module")
def paced(tiny_config):
    config = replace(
        tiny_config, "outer", schedule="paced", inner_steps=4, min_inner_steps=2, max_inner_steps=8
    )
    config = replace(config, "inner", warmup_steps=50)  # a rising learning rate shows the position
    dataset = TokenDataset.build(config.data, config.model.vocab_size, config.run.seed)
    return config, dataset


def _trained(config, dataset, peer, theta, budget_s, step_s=None):
    training = AnchorTraining(config, dataset, peer)
    training.rebase(training.rebase_from(theta, next_round=theta.params_round + 1))
    training.budget_s, training.step_s = budget_s, step_s
    return training, training.train_round(theta.params_round + 1)


def test_an_anchor_trains_to_its_budget_within_floor_and_cap_at_the_swarms_schedule(paced):
    config, dataset = paced
    o = config.outer
    theta = GlobalModel(config)
    theta.params_round = 6  # the swarm is at round 7
    fresh, first = _trained(config, dataset, "anchor-a", theta, budget_s=None)
    assert first.steps == o.inner_steps  # no budget yet: H
    roomy, long = _trained(config, dataset, "anchor-b", theta, budget_s=3600.0, step_s=0.001)
    assert long.steps == o.step_cap and roomy.trainer.step == o.step_cap
    # its last step ran at the swarm's position for round 7, not at its own step count
    lr = roomy.trainer.optimizer.param_groups[0]["lr"]
    assert lr == roomy.trainer.lr_at(schedule_position(7, o.step_cap - 1, o.inner_steps, o.step_cap))
    assert lr < roomy.trainer.lr_at(8 * o.inner_steps)  # never ahead of the next round's
    tight, short = _trained(config, dataset, "anchor-c", theta, budget_s=1e-3, step_s=0.5e-3)
    assert short.steps == o.step_floor and short.payloads  # the floor, announced
    # what the round's close took (compress, encode) is measured: a record's floor includes it
    assert tight.close_s is not None and tight.close_s > 0
    assert floor_seconds(o.step_floor, tight.step_s, 600.0, tight.close_s) > o.step_floor * tight.step_s
    slow, sat = _trained(config, dataset, "anchor-d", theta, budget_s=1.0, step_s=10.0)
    assert sat.sat_out and sat.steps == 0 and slow.trainer.step == 0  # trains nothing, says so


def test_a_round_ahead_takes_steps_instead_of_waiting_for_the_theta_it_needs(paced):
    """Overlapped: at the end of its budget a replica whose θ of the round before is not here yet would
    stand still; it trains on, within its cap, and compresses once θ lands (the steps it names are its
    own: the payload's count)."""
    config, dataset = paced
    o = config.outer
    theta = GlobalModel(config)
    training = AnchorTraining(config, dataset, "anchor-e")
    training.rebase(training.rebase_from(theta, next_round=0))
    training.budget_s, training.step_s = 1e-3, 0.5e-3  # the budget allows the floor only
    assert training.train_round(0).steps == o.step_floor  # θ of the round before is here: the floor
    assert training.step_s is not None
    training.budget_s = o.step_floor * training.step_s  # its floor fits, not a step more
    inbox, result = RebaseInbox(), {}
    worker = threading.Thread(target=lambda: result.update(r=training.train_round(1, inbox)))
    worker.start()
    deadline = time.monotonic() + 60
    while training.trainer.step < o.step_floor + o.step_cap and time.monotonic() < deadline:
        worker.join(0.05)
    worker.join(0.5)  # θ after round 0 has not come: it trained to its cap, then waits
    assert worker.is_alive() and training.trainer.step == o.step_floor + o.step_cap
    theta.params_round = 0
    inbox.post(training.rebase_from(theta))
    worker.join(60)
    trained = result["r"]
    assert trained.round == 1 and trained.steps == o.step_cap and trained.payloads


def test_a_slow_and_a_fast_honest_replica_are_judged_per_step(paced):
    """1, 8 and 32 steps in one round: judged by norm alone, the one-step replica's update is far below the
    median (measured: screened out, scoring −0.04); per step it is in, and scores positive."""
    config, dataset = paced
    config = replace(config, "outer", inner_steps=8, min_inner_steps=1, max_inner_steps=32)
    theta = GlobalModel(config)
    budgets = {"even-a": None, "even-b": None, "even-c": None, "slow-d": 1e-3, "fast-e": 3600.0}
    steps, contributions = {}, []
    for peer, budget in budgets.items():
        _, trained = _trained(config, dataset, peer, theta, budget_s=budget, step_s=budget and 1e-4)
        steps[peer] = trained.steps
        contributions.append((peer, theta.decode_contribution(peer, trained.round, trained.payloads)))
    assert sorted(set(steps.values())) == [1, 8, 32]
    model = build_model(config.model, seed=config.run.seed)
    model.fixed_embedding = base_fixed_embedding(config)
    verifier = Verifier(config, dataset, model)
    round_ = theta.params_round + 1
    assert verifier.screen(round_, contributions, None, steps) == {}
    replicas = {peer: Replica(peer, data_slot(peer)) for peer, _ in contributions}
    scores = verifier.score(round_, theta.params, contributions, replicas, steps)
    assert set(scores) == set(budgets) and min(scores.values()) >= 0, scores


def test_a_claim_of_more_steps_than_taken_shows_in_the_updates_norm(paced):
    """Updates of 2, 4 and 8 steps from one θ, in a warm-up (the learning rate rises step by step), claimed
    truly, and one of 4 claimed as 8: each counts the steps it took, whatever was claimed; strangers (weight
    0) claiming one step for a big update cannot change what one step's norm is."""
    config, dataset = paced
    theta = GlobalModel(config)
    taken = {"two": 2, "four": 4, "eight": 8, "liar": 4}
    claimed = taken | {"liar": 8}
    updates = {}
    for peer, steps in taken.items():
        training = AnchorTraining(config, dataset, peer)
        training.rebase(training.rebase_from(theta, next_round=0))
        trained = training.train_round(0, steps=steps)
        decoded = theta.decode_contribution(peer, 0, trained.payloads)
        updates[peer] = {n: v for m in decoded for n, v in m.sparse.items()}
    honest = dict.fromkeys(taken, 1)
    counted = verified_steps(config, 0, updates, claimed, honest)
    assert counted == taken, counted  # the liar: the 4 it took, not the 8 it claimed
    # without the learning rate (steps as if all at one rate), a warm-up's rising rate misjudges them
    shown = steps_shown(updates, claimed, honest)
    assert shown["two"] < 2 / STEPS_SLACK or shown["eight"] > 8 * STEPS_SLACK, shown
    strangers = {f"stranger-{i}": updates["eight"] for i in range(5)}
    crowd = verified_steps(config, 0, updates | strangers, claimed | dict.fromkeys(strangers, 1), honest)
    assert {p: crowd[p] for p in taken} == taken
