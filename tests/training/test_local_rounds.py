"""The rebase rule (docs/sync.md, "Overlap"): progress kept, lockstep exact, error feedback per round, at most
one unapplied round ahead, a stop that never hangs, and the local-state writer."""

import threading
import time

import pytest
import torch

from hetnode.algo.sparseloco import ErrorFeedback, SparseLoCoCodec
from hetnode.config import Config, replace
from hetnode.daemon.rounds import AnchorTraining
from hetnode.data import TokenDataset
from hetnode.replica.global_model import GlobalModel
from hetnode.service.state_writer import LatestStateWriter
from hetnode.training.local_rounds import LocalRounds, Rebase, RebaseInbox, TrainingStopped


def _rebase(round_: int, reference: dict, left_out=()) -> Rebase:
    return Rebase(round_, round_ + 1, reference, None, reference, None, tuple(left_out))


def _local(values: list[float]) -> LocalRounds:
    params = {"w": torch.nn.Parameter(torch.tensor(values))}
    return LocalRounds(params, ErrorFeedback(SparseLoCoCodec(64, 64), 0.95))


def test_a_rebase_keeps_the_progress_since_the_round_began():
    local = _local([1.0, 2.0])
    local.rebase(_rebase(0, {"w": torch.tensor([1.0, 2.0])}))
    with torch.no_grad():
        local.params["w"].sub_(torch.tensor([0.5, 0.25]))  # two inner steps' worth of progress
    local.rebase(_rebase(1, {"w": torch.tensor([10.0, 20.0])}))
    assert torch.equal(local.params["w"].detach(), torch.tensor([9.5, 19.75]))
    assert torch.equal(local.start["w"], torch.tensor([10.0, 20.0]))
    assert torch.equal(local.pseudo_gradient()["w"], torch.tensor([0.5, 0.25]))  # Δ counts from there
    assert (local.base, local.next_round) == (1, 2)


def test_in_lockstep_the_rebase_is_exactly_the_reset_to_theta():
    # w + (θ − w) is not θ in floating point; the rule computes θ + (w − s) with w − s = 0 exactly
    local = _local([1e-8, 3.0])
    theta = {"w": torch.tensor([1.0, 1e-7])}
    local.rebase(_rebase(0, theta))
    assert torch.equal(local.params["w"].detach(), theta["w"])


def test_error_feedback_is_settled_by_round_not_by_the_last_payload():
    local = _local([0.0] * 64)
    local.rebase(_rebase(0, {"w": torch.zeros(64)}))
    with torch.no_grad():
        local.params["w"].sub_(torch.linspace(0.1, 1.0, 64))
    local.compress(1)
    after_first = local.feedback.buffers["w"].clone()
    first = local.unsent[1]
    with torch.no_grad():
        local.params["w"].sub_(torch.linspace(-1.0, 0.3, 64))
    local.compress(2)  # round 2 compressed before round 1 is settled (a late seal)
    assert set(local.unsent) == {1, 2}
    before = local.feedback.buffers["w"].clone()
    local.restore([1])  # round 1 was left out: exactly its payload goes back
    codec = SparseLoCoCodec(64, 64)
    assert torch.allclose(local.feedback.buffers["w"], before + codec.decompress(first["w"]))
    assert set(local.unsent) == {2} and not torch.equal(after_first, before)
    local.rebase(_rebase(2, {"w": torch.zeros(64)}))  # θ after round 2: round 2's payload is settled too
    assert local.unsent == {}


def test_a_rebase_settles_every_earlier_round_and_restores_only_the_left_out():
    local = _local([0.0] * 64)
    local.rebase(_rebase(0, {"w": torch.zeros(64)}))
    with torch.no_grad():
        local.params["w"].sub_(torch.linspace(0.1, 1.0, 64))
    sent = local.compress(1)["w"]
    buffer = local.feedback.buffers["w"].clone()
    local.rebase(_rebase(1, {"w": torch.zeros(64)}, left_out=[1]))
    assert torch.allclose(local.feedback.buffers["w"], buffer + SparseLoCoCodec(64, 64).decompress(sent))
    assert local.unsent == {}


def test_the_naive_rule_goes_back_to_theta_after_compressing():
    params = {"w": torch.nn.Parameter(torch.tensor([1.0, 2.0]))}
    local = LocalRounds(params, ErrorFeedback(SparseLoCoCodec(64, 64), 0.95), ahead_from="theta")
    local.rebase(_rebase(0, {"w": torch.tensor([1.0, 2.0])}))
    with torch.no_grad():
        params["w"].sub_(1.0)
    local.compress(1)
    assert torch.equal(params["w"].detach(), torch.tensor([1.0, 2.0]))


def test_the_eager_rule_runs_ahead_from_theta_moved_by_our_own_update_at_its_weight():
    params = {"w": torch.nn.Parameter(torch.zeros(64))}
    local = LocalRounds(params, ErrorFeedback(SparseLoCoCodec(64, 64), 0.95), "eager", outer_lr=2.0)
    rebase = Rebase(0, 1, {"w": torch.zeros(64)}, None, {"w": torch.zeros(64)}, None, (), share=0.25)
    local.rebase(rebase)
    with torch.no_grad():
        params["w"].sub_(torch.linspace(0.1, 1.0, 64))
    sent = local.compress(1)["w"]
    guess = -2.0 * 0.25 * SparseLoCoCodec(64, 64).decompress(sent)  # θ⁰ − α·share·deq(Δ̂)
    assert torch.allclose(params["w"].detach(), guess) and torch.equal(local.start["w"], params["w"].detach())


@pytest.fixture
def dataset(tiny_config: Config) -> TokenDataset:
    return TokenDataset.build(tiny_config.data, tiny_config.model.vocab_size, seed=tiny_config.run.seed)


@pytest.fixture
def anchor(tiny_config: Config, dataset: TokenDataset) -> tuple[AnchorTraining, GlobalModel]:
    config = replace(tiny_config, "outer", inner_steps=3)
    model = GlobalModel(config)
    training = AnchorTraining(config, dataset, "peer-a")
    training.rebase(training.rebase_from(model))
    return training, model


def test_a_round_ahead_waits_for_the_round_before_and_names_it_as_its_base(anchor):
    training, model = anchor
    training.train_round(0)  # round 0, from θ⁰
    inbox, result = RebaseInbox(), {}
    worker = threading.Thread(target=lambda: result.update(r=training.train_round(1, inbox)))
    worker.start()
    deadline = time.monotonic() + 60
    while training.trainer.step < 6 and time.monotonic() < deadline:  # round 1's three steps done
        time.sleep(0.05)
    time.sleep(0.5)
    assert worker.is_alive()  # its steps are done, its payload waits: θ after round 0 is not here yet
    model.params_round = 0  # as if round 0 were applied (θ unchanged: only the label matters here)
    inbox.post(training.rebase_from(model))
    worker.join(30)
    trained = result["r"]
    assert trained.round == 1 and trained.timing.wait_s >= 0.5
    assert trained.timing.rebased_at_step == [-1]  # it landed after the last step
    assert training.local.base == 0 and set(training.local.unsent) == {1}


def test_theta_of_a_newer_round_relabels_the_work(anchor):
    training, model = anchor
    model.params_round = 6  # a catch-up landed while round 1 trained
    inbox = RebaseInbox()
    inbox.post(training.rebase_from(model))
    trained = training.train_round(1, inbox)
    assert trained.round == 7 and training.local.base == 6


def test_a_stop_ends_a_waiting_round(anchor):
    training, _ = anchor
    training.train_round(0)
    inbox, raised = RebaseInbox(), []

    def run():
        try:
            training.train_round(1, inbox)
        except TrainingStopped:
            raised.append(True)

    worker = threading.Thread(target=run)
    worker.start()
    time.sleep(0.5)
    inbox.close()
    worker.join(10)
    assert raised == [True]


def test_the_local_state_is_a_copy_without_the_trainers_weights(anchor):
    training, model = anchor
    state = training.local_state()
    assert "model" not in state["trainer"] and state["params_round"] == -1
    buffers_before = {n: b.clone() for n, b in state["feedback"]["buffers"].items()}
    training.train_round(0)  # training goes on: the copy does not change
    assert all(torch.equal(buffers_before[n], b) for n, b in state["feedback"]["buffers"].items())
    assert all(torch.equal(state["global_params"][n], model.params[n]) for n in model.params)


def test_the_state_writer_writes_the_newest_and_survives_a_failed_write():
    written, gate = [], threading.Event()

    def write(state):
        gate.wait(5)
        if state.get("fail"):
            raise OSError("disk full")
        written.append(state["n"])

    writer = LatestStateWriter(write)
    writer.submit({"n": 1})
    time.sleep(0.2)  # the first write has started and waits on the gate
    for n in (2, 3, 4):
        writer.submit({"n": n})
    gate.set()
    assert writer.flush(5)
    assert written == [1, 4]  # 2 and 3 were replaced while 1 was written
    writer.submit({"fail": True})
    writer.submit({"n": 5})
    writer.close()
    assert written[-1] == 5
