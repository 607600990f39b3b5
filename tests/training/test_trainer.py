"""The inner loop: learning happens, checkpoints resume exactly, the CLI writes its outputs."""

import json
from pathlib import Path

import pytest
import torch

from hetnode.cli.main import main
from hetnode.config import Config, replace
from hetnode.data import TokenDataset
from hetnode.model import build_model
from hetnode.training.schedule import warmup_cosine
from hetnode.training.trainer import InnerTrainer, load_checkpoint, save_checkpoint


@pytest.fixture(scope="module")
def dataset(tiny_config: Config) -> TokenDataset:
    return TokenDataset.build(tiny_config.data, tiny_config.model.vocab_size, seed=tiny_config.run.seed)


def _trainer(config: Config, dataset: TokenDataset) -> InnerTrainer:
    return InnerTrainer(config, build_model(config.model, seed=config.run.seed), dataset)


def test_schedule_warms_up_then_decays():
    lrs = [warmup_cosine(s, 1.0, 10, 100, 0.1) for s in range(100)]
    assert lrs[0] == pytest.approx(0.1) and lrs[9] == pytest.approx(1.0)
    assert all(a >= b for a, b in zip(lrs[9:], lrs[10:], strict=False))
    assert lrs[-1] == pytest.approx(0.1, abs=1e-3)


def test_sixty_steps_reduce_eval_loss(tiny_config: Config, dataset: TokenDataset):
    config = replace(tiny_config, "train", max_steps=60)
    trainer = _trainer(config, dataset)
    before = trainer.evaluate()
    losses = [trainer.train_step().loss for _ in range(60)]
    after = trainer.evaluate()
    assert before > 5.0  # ~ln(320) at init: nothing learned yet
    assert after < before - 1.5, (before, after)
    assert sum(losses[-10:]) / 10 < sum(losses[:10]) / 10
    assert trainer.tokens == 60 * config.data.batch_size * config.data.seq_len


def test_checkpoint_resume_gives_identical_next_step(
    tiny_config: Config, dataset: TokenDataset, tmp_path: Path
):
    first = _trainer(tiny_config, dataset)
    for _ in range(5):
        first.train_step()
    save_checkpoint(tmp_path / "ckpt.pt", first.state_dict())
    expected_loss = first.train_step().loss

    resumed = _trainer(
        replace(tiny_config, "run", seed=99), dataset
    )  # different init, overwritten by the load
    resumed.load_state_dict(load_checkpoint(tmp_path / "ckpt.pt"))
    assert resumed.step == 5
    assert resumed.train_step().loss == expected_loss
    for (name, a), (_, b) in zip(
        first.model.state_dict().items(), resumed.model.state_dict().items(), strict=True
    ):
        assert torch.equal(a, b), name


def test_checkpoint_of_another_model_is_refused(tiny_config: Config, dataset: TokenDataset, tmp_path: Path):
    from hetnode.errors import CheckpointError

    trainer = _trainer(tiny_config, dataset)
    save_checkpoint(tmp_path / "ckpt.pt", trainer.state_dict())
    other = replace(tiny_config, "model", n_layers=2)
    with pytest.raises(CheckpointError, match="model"):
        _trainer(other, dataset).load_state_dict(load_checkpoint(tmp_path / "ckpt.pt"))
    (tmp_path / "junk.pt").write_bytes(b"not a checkpoint")
    with pytest.raises(CheckpointError, match="unreadable"):
        load_checkpoint(tmp_path / "junk.pt")


def test_slots_train_on_different_batches(tiny_config: Config, dataset: TokenDataset):
    a = InnerTrainer(tiny_config, build_model(tiny_config.model), dataset, slots=[0], num_slots=2)
    b = InnerTrainer(tiny_config, build_model(tiny_config.model), dataset, slots=[1], num_slots=2)
    assert a.train_step().loss != b.train_step().loss


def test_multi_slot_step_averages_the_slots_gradients(tiny_config: Config, dataset: TokenDataset):
    """One trainer over slots {0, 1} takes the step synchronous DDP over two replicas would take."""
    config = replace(tiny_config, "inner", grad_clip=0.0)
    both = InnerTrainer(config, build_model(config.model), dataset, slots=[0, 1], num_slots=2)
    both.train_step()
    model = build_model(config.model)
    for slot in (0, 1):
        inputs, targets = dataset.train_batch(slot, 2, 0)
        (model.loss(inputs, targets) / 2).backward()
    reference = InnerTrainer(config, model, dataset)
    for group in reference.optimizer.param_groups:
        group["lr"] = reference.lr_at(0)
    reference.optimizer.step()
    for (name, a), b in zip(both.model.state_dict().items(), model.state_dict().values(), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7, msg=name)
    assert both.tokens == 2 * config.data.batch_size * config.data.seq_len


def test_cli_train_writes_outputs_and_resumes(tiny_config: Config, tmp_path: Path, capsys):
    config_path = tmp_path / "tiny.toml"
    config_path.write_text(
        f'[run]\nname = "cli"\n[data]\ndata_dir = "{tiny_config.data.data_dir}"\n'
        "[train]\nmax_steps = 20\neval_every = 10\ncheckpoint_every = 10\nlog_every = 5\n"
    )
    out = tmp_path / "out"
    args = ["train", "--config", str(config_path), "--out", str(out), "--no-progress"]
    assert main([*args, "--max-steps", "10"]) == 0
    assert main([*args, "--max-steps", "20", "--resume"]) == 0
    printed = capsys.readouterr().out
    assert "eval loss" in printed and str(out) in printed
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if "eval_loss" in r] == [0, 10, 20]
    assert (out / "loss.png").stat().st_size > 1000
    assert load_checkpoint(out / "trainer-state-000020.safetensors")["step"] == 20
    assert [p.name for p in (out / "checkpoints").iterdir()] == ["round-000020"]  # the coordinator's format
