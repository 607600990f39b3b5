"""One gradient frame must not break an honest stage for good: honest frames of a real tiny chain pass the
wire's bounds with room to spare, and a huge or non-finite gradient that got past them anyway is refused by
the stage before its weights, optimiser or error feedback change, so the next round trains as if it had
never come."""

from __future__ import annotations

import pytest
import torch

from hetnode.config import replace
from hetnode.daemon.stage_training import StageTraining, stage_part
from hetnode.data.dataset import TokenDataset
from hetnode.errors import UpdateRefused
from hetnode.replica.global_model import GlobalModel
from hetnode.training.local_rounds import snapshot_optimizer
from hetnode.training.stage_worker import Frame
from hetnode.wire.activation_frame import decode_frame, encode_frame

MARGIN = 1e3  # honest frames stay this far below the bounds (measured: 2.6e4 and more on tiny)


@pytest.fixture(scope="module")
def config(tiny_config):
    return replace(tiny_config, "outer", inner_steps=2)


@pytest.fixture(scope="module")
def dataset(config):
    return TokenDataset.build(config.data, config.model.vocab_size, config.run.seed)


def _chain(config, dataset, compress: bool | None = None) -> list[tuple[StageTraining, GlobalModel]]:
    """The two stages of a chain, each with its slice of θ⁰, standing on it."""
    n = config.model.n_layers
    splits = (range(0, n // 2), range(n // 2, n))
    chain = []
    for i in range(2):
        stage = StageTraining(config, splits, i, "chain-x", dataset if i == 0 else None, compress=compress)
        model = GlobalModel(config, part=stage_part(splits, i, compressed=True))
        stage.rebase(stage.rebase_from(model))
        chain.append((stage, model))
    return chain


def _begin(chain, round_: int) -> None:
    """Start `round_`; θ after the round before (unchanged here) is stood on first, so it may compress."""
    for stage, model in chain:
        if model.params_round < round_ - 1:
            model.params_round = round_ - 1
            stage.rebase(stage.rebase_from(model))
    (first, _), (last, _) = chain
    first.begin_round(round_)
    last.begin_round(round_, first.drift_base)


def _over_the_wire(chain, round_: int, peaks: dict[str, float]) -> None:
    """One micro-batch, each frame encoded and decoded with the receiver's limits as the network does."""
    (first, _), (last, _) = chain
    mb, batch = first.next_batch()
    frame = first.forward(mb, batch)
    sent = encode_frame("act", round_, mb, frame.tensor, frame.tokens, frame.targets)
    act = decode_frame(sent, last.limits, "act", expect_round=round_)
    last.forward(mb, Frame(mb, act.tensor, act.tokens, act.targets))
    grad = decode_frame(encode_frame("grad", round_, mb, last.backward(mb)), first.limits, "grad", round_)
    first.backward(mb, grad.tensor)
    for kind, tensor in (("act", act.tensor), ("grad", grad.tensor)):
        peaks[kind] = max(peaks.get(kind, 0.0), float(tensor.float().abs().max()))


def _train_round(chain, round_: int, peaks: dict[str, float]) -> None:
    _begin(chain, round_)
    for _ in range(chain[0][0].config.outer.inner_steps):
        _over_the_wire(chain, round_, peaks)
    for stage, _ in chain:
        stage.end_round(round_, "peer-x")


def _state(stage: StageTraining) -> dict:
    """Everything a step or a compression could change, copied."""
    return {
        "weights": {n: p.detach().clone() for n, p in stage.worker.stage.named_parameters()},
        "optimizer": snapshot_optimizer(stage.worker.optimizer),
        "feedback": stage.feedback.state_dict(),
        "version": stage.worker.version,
    }


def _assert_identical(before, after, where: str = "") -> None:
    if isinstance(before, torch.Tensor):
        assert torch.equal(before, after), where
    elif isinstance(before, dict):
        assert before.keys() == after.keys(), where
        for key in before:
            _assert_identical(before[key], after[key], f"{where}/{key}")
    elif isinstance(before, list | tuple):
        assert len(before) == len(after), where
        for i, (b, a) in enumerate(zip(before, after, strict=True)):
            _assert_identical(b, a, f"{where}/{i}")
    else:
        assert before == after, where


@pytest.mark.parametrize("compress", [True, False], ids=["bf16-coefficients", "dense-fp32"])
def test_honest_frames_of_a_tiny_chain_pass_far_below_the_bounds(config, dataset, compress):
    chain = _chain(config, dataset, compress)
    peaks: dict[str, float] = {}
    _train_round(chain, 0, peaks)  # the first steps from θ⁰: where the measured maxima occur
    limits = chain[1][0].limits
    assert 0 < peaks["act"] * MARGIN < limits.value_bound("act")
    assert 0 < peaks["grad"] * MARGIN < limits.value_bound("grad")


def test_a_gradient_past_the_wire_changes_nothing_and_the_next_round_trains_as_without_it(config, dataset):
    attacked, control = _chain(config, dataset), _chain(config, dataset)
    peaks: dict[str, float] = {}
    for chain in (attacked, control):
        _train_round(chain, 0, peaks)  # optimiser state and error feedback are not empty any more
        _begin(chain, 1)
    (first, _), (last, _) = attacked
    skip = control[0][0].next_batch  # the control skips the data of the refused micro-batches
    before = [_state(stage) for stage, _ in attacked]
    shape = (config.data.batch_size, config.data.seq_len, config.pipeline.subspace_rank)
    for bad in (3e38, 1e30, float("nan"), float("inf")):  # fed straight to the first stage's backward
        mb, batch = first.next_batch()
        skip()
        first.forward(mb, batch)
        with pytest.raises(UpdateRefused, match=f"micro-batch {mb}"):
            first.backward(mb, torch.full(shape, bad).to(torch.bfloat16))
        assert not first.in_flight(mb)  # dropped
    mb, batch = first.next_batch()
    skip()
    frame = first.forward(mb, batch)
    poisoned = frame.tensor.clone()
    poisoned[0, 0, 0] = float("nan")  # an activation past the wire: the last stage's own gradients
    last.forward(mb, Frame(mb, poisoned, frame.tokens, frame.targets))
    with pytest.raises(UpdateRefused):
        last.backward(mb)
    first.worker.drop_in_flight()  # its gradient never comes: the chain dropped the micro-batch
    for (stage, _), state in zip(attacked, before, strict=True):
        _assert_identical(state, _state(stage))

    for chain in (attacked, control):
        for _ in range(config.outer.inner_steps):
            _over_the_wire(chain, 1, peaks)
    payloads = [[stage.end_round(1, "peer-x") for stage, _ in chain] for chain in (attacked, control)]
    assert payloads[0] == payloads[1]  # bit for bit: nothing of the refused micro-batches stayed
    for (stage, _), (twin, _) in zip(attacked, control, strict=True):
        _assert_identical(_state(twin), _state(stage))
        assert stage.worker.version == 2 * config.outer.inner_steps
