"""A chain stage saves and resumes its error feedback, optimiser and round like an anchor; a stage of
another split keeps only the error feedback of the tensors it still holds."""

from __future__ import annotations

import pytest
import torch

from hetnode.config import replace
from hetnode.daemon.stage_training import StageTraining, stage_part
from hetnode.data.dataset import TokenDataset
from hetnode.errors import CheckpointError
from hetnode.replica.global_model import GlobalModel
from hetnode.wire.sync_payload import decode_payload


def _chain(config, splits, dataset):
    stages = [StageTraining(config, splits, i, "chain-x", dataset if i == 0 else None) for i in range(2)]
    models = [GlobalModel(config, part=stage_part(splits, i, compressed=True)) for i in range(2)]
    return stages, models


def _train_round(stages, models, micro_batches: int) -> None:
    first, last = stages
    for stage, model in zip(stages, models, strict=True):
        stage.rebase(stage.rebase_from(model))
    first.begin_round(0)
    last.begin_round(0, first.drift_base)
    for _ in range(micro_batches):
        _micro_batch(first, last)
    for stage in stages:
        stage.end_round(0, "peer-x")


def _micro_batch(first, last) -> None:
    mb, batch = first.next_batch()
    last.forward(mb, first.forward(mb, batch))
    first.backward(mb, last.backward(mb))


def _trained_chain(tiny_config):
    """A chain of two stages after one round of 2 micro-batches: (config, splits, stages, models)."""
    config = replace(tiny_config, "outer", inner_steps=2)
    n = config.model.n_layers
    splits = (range(0, n // 2), range(n // 2, n))
    dataset = TokenDataset.build(config.data, config.model.vocab_size, config.run.seed)
    stages, models = _chain(config, splits, dataset)
    _train_round(stages, models, 2)
    return config, splits, stages, models


def test_a_stage_resumes_error_feedback_optimiser_and_round(tiny_config, tmp_path):
    config, splits, stages, models = _trained_chain(tiny_config)
    n = config.model.n_layers
    models[1].params_round, models[1].seal_hash = 0, "ab" * 32
    stages[1].rebase(stages[1].rebase_from(models[1]))  # round 0 applied: its payload settled
    path = tmp_path / "stage-state.pt"
    stages[1].save_local_state(path)

    again, fresh = (
        StageTraining(config, splits, 1, "chain-y", None),
        GlobalModel(config, part=stage_part(splits, 1, compressed=True)),
    )
    assert again.load_local_state(tmp_path / "absent.pt", fresh) is None
    assert again.load_local_state(path, fresh) == "all"
    assert fresh.params_round == 0 and fresh.seal_hash == "ab" * 32 and fresh.digests() == models[1].digests()
    assert again.feedback_norm() == pytest.approx(stages[1].feedback_norm()) and again.feedback_norm() > 0
    for name, buffer in stages[1].feedback.buffers.items():
        assert torch.equal(again.feedback.buffers[name], buffer)
    assert again.worker.version == stages[1].worker.version == 2
    saved, loaded = stages[1].worker.optimizer.state_dict(), again.worker.optimizer.state_dict()
    assert saved["state"].keys() == loaded["state"].keys() and saved["state"]
    for key, entry in saved["state"].items():
        for field, value in entry.items():
            if isinstance(value, torch.Tensor):
                assert torch.equal(loaded["state"][key][field], value), (key, field)

    # three stages now: stage 1 holds some of the layers it held before, the rest of its debt is gone
    other = (range(0, 1), range(1, n - 1), range(n - 1, n))
    moved = StageTraining(config, other, 2, "chain-z", None)
    moved_model = GlobalModel(config, part=stage_part(other, 2, compressed=True))
    assert moved.load_local_state(path, moved_model) == "feedback"
    assert set(moved.feedback.buffers) == set(stages[1].feedback.buffers) & set(moved.names)
    assert moved_model.params_round == -1  # θ comes from a catch-up

    path.write_bytes(b"not a torch file")
    with pytest.raises(CheckpointError, match="unreadable"):
        again.load_local_state(path, fresh)


def test_a_stage_trains_ahead_and_stands_on_new_theta_between_micro_batches(tiny_config):
    """Overlap on a chain: round 1 trains from the guess while round 0 syncs; θ after round 0 lands between
    two micro-batches and each stage stands on it keeping its progress; a payload the seal left out goes
    back into error feedback; round 1 is compressed only on θ after round 0, and its payload says so."""
    config = replace(tiny_config, "outer", inner_steps=2)
    n = config.model.n_layers
    splits = (range(0, n // 2), range(n // 2, n))
    dataset = TokenDataset.build(config.data, config.model.vocab_size, config.run.seed)
    stages, models = _chain(config, splits, dataset)
    _train_round(stages, models, 2)  # round 0, compressed and "announced"
    first, last = stages
    first.begin_round(1)
    last.begin_round(1, first.drift_base)  # T_fix' of round 1: from θ the first stage stands on (−1)
    fixed = last.worker.constraint.fixed.clone()
    _micro_batch(first, last)
    with pytest.raises(RuntimeError, match="round 1 is compressed on θ after round 0"):
        first.end_round(1, "peer-x")

    norms = [stage.feedback_norm() for stage in stages]
    for stage, model in zip(stages, models, strict=True):  # the seal of round 0 lands
        with torch.no_grad():
            for tensor in model.params.values():
                tensor.add_(torch.randn_like(tensor) * 1e-3)
        model.params_round = 0
        progress = {n: p.detach() - stage.local.start[n] for n, p in stage.local.params.items()}
        left_out = (0,) if stage is last else ()
        stage.rebase(stage.rebase_from(model, left_out))
        reference = stage.rebase_from(model).reference
        for name, param in stage.local.params.items():  # w = P(θ⁰) + progress: nothing learned is lost
            torch.testing.assert_close(param.detach(), reference[name] + progress[name])
    assert first.feedback_norm() == pytest.approx(norms[0])  # sealed: settled, not restored
    assert last.feedback_norm() > norms[1]  # left out: what it sent is owed again
    assert torch.equal(last.worker.constraint.fixed, fixed)  # T_fix' changes only with the next round

    _micro_batch(first, last)
    for stage, model in zip(stages, models, strict=True):
        for shard, data in stage.end_round(1, "peer-x").items():
            decoded = decode_payload(data, model.sparse_specs[shard])
            assert decoded.base == 0 and decoded.round == 1


def test_a_first_stage_defers_refusals_only_on_an_accelerator_and_reports_them_once_a_round(
    tiny_config, caplog
):
    config = replace(tiny_config, "outer", inner_steps=2)
    n = config.model.n_layers
    splits = (range(0, n // 2), range(n // 2, n))
    dataset = TokenDataset.build(config.data, config.model.vocab_size, config.run.seed)
    stages, models = _chain(config, splits, dataset)
    assert not stages[0].worker.defer_refusals  # on CPU the flag read per micro-batch costs no device wait
    stages[0].worker.defer_refusals = True  # as on a GPU
    stages[0].worker.refusals = torch.tensor(2)  # two refused on the device this round
    with caplog.at_level("WARNING", logger="hetnode.daemon.stage_training"):
        _train_round(stages, models, 2)
    assert "2 micro-batches had gradients that were not finite" in caplog.text
    assert stages[0].worker.take_refusals() == 0  # read once, at the round's end


def test_a_spare_adds_the_feedback_its_predecessor_left_at_its_next_round_end(tiny_config):
    """A predecessor's error feedback, handed over while the spare's round trains, goes out with the
    spare's next payload exactly as if the spare had held it all along."""
    config, splits, stages, _ = _trained_chain(tiny_config)
    left = {name: buffer.clone() for name, buffer in stages[1].feedback.buffers.items()}
    assert left and stages[1].feedback_norm() > 0
    spare, holder = (StageTraining(config, splits, 1, "chain-y", None) for _ in range(2))
    spare.hand_over(left)
    holder.feedback.buffers.update({name: t.clone() for name, t in left.items()})
    assert spare.feedback_norm() == 0  # not yet: its training thread adds it, at the round's end
    payloads = []
    for stage in (spare, holder):
        model = GlobalModel(config, part=stage_part(splits, 1, compressed=True))
        stage.rebase(stage.rebase_from(model))
        stage.begin_round(0, stages[0].drift_base)
        payloads.append(stage.end_round(0, "peer-y"))
    assert payloads[0] == payloads[1]
    for name, buffer in holder.feedback.buffers.items():
        assert torch.equal(spare.feedback.buffers[name], buffer)
    assert spare.feedback_norm() > 0
