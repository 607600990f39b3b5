"""A `hetnode train` run writes the coordinator's checkpoint format, resumes exactly from it, converts an
old `checkpoint.pt` once, and `export` / `sample` take the run's folder (issue 33, items 2 and 12)."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch

from hetnode.cli.main import main
from hetnode.config import Config, dump_config, replace
from hetnode.data import TokenDataset
from hetnode.export.source import load_global_model, open_checkpoint
from hetnode.model import build_model
from hetnode.replica.checkpoint import load_checkpoint
from hetnode.training.run_checkpoints import resume_run, save_run_checkpoint
from hetnode.training.trainer import InnerTrainer

PROMPT = "The river"


@pytest.fixture(scope="module")
def quick_config(tiny_config: Config) -> Config:
    """tiny, smaller and with one eval batch: a CLI run of a few steps takes a second or two."""
    config = replace(tiny_config, "model", d_model=64, n_layers=2, ffn_hidden=176)
    config = replace(config, "data", batch_size=4, seq_len=64)
    config = replace(config, "run", name="quick")
    return replace(
        config, "train", max_steps=4, eval_every=100, eval_batches=1, checkpoint_every=2, log_every=1
    )


@pytest.fixture(scope="module")
def config_file(quick_config: Config, tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("config") / "quick.toml"
    path.write_text(dump_config(quick_config))
    return path


@pytest.fixture(scope="module")
def dataset(quick_config: Config) -> TokenDataset:
    return TokenDataset.build(quick_config.data, quick_config.model.vocab_size, seed=quick_config.run.seed)


def _trainer(config: Config, dataset: TokenDataset) -> InnerTrainer:
    return InnerTrainer(config, build_model(config.model, seed=config.run.seed), dataset)


def _train(config_file: Path, out: Path, *flags: str) -> int:
    return main(["train", "--config", str(config_file), "--out", str(out), "--no-progress", *flags])


def test_a_train_run_can_be_exported_and_sampled_from_its_folder(
    config_file: Path, tmp_path: Path, capsys, caplog
):
    run = tmp_path / "try"
    caplog.set_level(logging.DEBUG)
    assert _train(config_file, run, "--max-steps", "2") == 0
    printed = capsys.readouterr().out
    assert f"{run}/checkpoints/round-000002/" in printed and f"hetnode sample --from {run}" in printed
    assert sorted(p.name for p in run.iterdir()) == [
        "checkpoints",
        "loss.png",
        "metrics.jsonl",
        "trainer-state-000002.safetensors",
    ]
    # item 12: the whole config at DEBUG only; at INFO one short line naming the file and the run
    told = [r for r in caplog.records if r.name == "hetnode.cli.train"]
    assert [r.levelno for r in told if "effective config" in r.getMessage()] == [logging.DEBUG]
    info = [r.getMessage() for r in told if r.levelno == logging.INFO]
    assert info == [f"config {config_file} (run quick); -v prints it whole"]

    assert main(["export", "--from", str(run), "--out", str(tmp_path / "hf")]) == 0
    assert "exported θ after step 2 of `hetnode train`" in capsys.readouterr().out
    assert (tmp_path / "hf" / "model.safetensors").is_file()
    weights = run / "checkpoints" / "round-000002" / "model.safetensors"
    for source in (run, weights):  # the folder, or the file in it the user has at hand
        assert main(["sample", "--from", str(source), "--prompt", PROMPT, "--tokens", "8"]) == 0
        assert capsys.readouterr().out.startswith(PROMPT)  # the prompt as given, then the continuation
    assert any("is a `hetnode train` run folder" in r.getMessage() for r in caplog.records)

    # the old file name: the message points at the run folder
    assert main(["sample", "--from", str(run / "checkpoint.pt"), "--prompt", PROMPT]) == 2
    assert f"pass --from {run}" in capsys.readouterr().err


def test_the_exported_model_is_the_trained_one(quick_config: Config, dataset: TokenDataset, tmp_path: Path):
    """tiny compresses (a swarm adds T_fix at the input), a local run does not: its checkpoint must say so."""
    assert quick_config.pipeline.compression != "none"
    trainer = _trainer(quick_config, dataset)
    trainer.train_step()
    save_run_checkpoint(tmp_path, quick_config, trainer)
    checkpoint = open_checkpoint(str(tmp_path))
    assert checkpoint.config.pipeline.compression == "none"
    assert checkpoint.manifest.extra == {"trained_by": "hetnode train", "step": 1, "tokens": trainer.tokens}
    tokens = torch.arange(12).unsqueeze(0)
    with torch.no_grad():
        torch.testing.assert_close(load_global_model(checkpoint)(tokens), trainer.model.eval()(tokens))


def test_a_resume_continues_exactly(quick_config: Config, dataset: TokenDataset, tmp_path: Path):
    straight = _trainer(quick_config, dataset)
    for _ in range(4):
        straight.train_step()

    first = _trainer(quick_config, dataset)
    for _ in range(2):
        first.train_step()
    save_run_checkpoint(tmp_path, quick_config, first)
    torch.manual_seed(123)  # the RNG comes back as it was at the save
    resumed = _trainer(replace(quick_config, "run", seed=99), dataset)  # another init, replaced by the load
    assert resume_run(tmp_path, quick_config, resumed).name == "round-000002"
    assert (resumed.step, resumed.tokens) == (2, first.tokens)
    for _ in range(2):
        resumed.train_step()
    for (name, a), b in zip(
        straight.model.state_dict().items(), resumed.model.state_dict().values(), strict=True
    ):
        assert torch.equal(a, b), name  # the optimiser's moments came back too, or this step differs

    save_run_checkpoint(tmp_path, quick_config, resumed)  # only the newest is kept, with its state
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoints", "trainer-state-000004.safetensors"]
    assert [p.name for p in (tmp_path / "checkpoints").iterdir()] == ["round-000004"]


def test_an_old_checkpoint_pt_is_converted_once(
    config_file: Path, quick_config: Config, dataset: TokenDataset, tmp_path: Path, capsys
):
    run = tmp_path / "old"
    run.mkdir()
    trainer = _trainer(quick_config, dataset)
    for _ in range(2):
        trainer.train_step()
    torch.save(trainer.state_dict(), run / "checkpoint.pt")  # what `hetnode train` wrote before

    assert main(["sample", "--from", str(run), "--prompt", PROMPT]) == 2  # refused, with the command
    err = capsys.readouterr().err
    assert f"hetnode train --config CONFIG --out {run} --resume --max-steps 2" in err

    assert _train(config_file, run, "--resume", "--max-steps", "2") == 0
    assert not (run / "checkpoint.pt").exists() and (run / "checkpoint.pt.converted").is_file()
    params, manifest = load_checkpoint(run / "checkpoints" / "round-000002")
    assert manifest.extra["step"] == 2
    for name, tensor in trainer.model.state_dict().items():
        assert torch.equal(params[name], tensor), name
    assert _train(config_file, run, "--resume", "--max-steps", "3") == 0  # from the new format now
    assert [p.name for p in (run / "checkpoints").iterdir()] == ["round-000003"]
    assert main(["sample", "--from", str(run), "--prompt", PROMPT, "--tokens", "4"]) == 0


def test_resume_errors_are_usage_errors(config_file: Path, quick_config: Config, tmp_path: Path, capsys):
    assert _train(config_file, tmp_path / "empty", "--resume") == 2
    assert "holds no checkpoint to resume from" in capsys.readouterr().err
    assert _train(config_file, tmp_path / "run", "--max-steps", "2") == 0
    other = tmp_path / "other.toml"
    other.write_text(dump_config(replace(quick_config, "model", ffn_hidden=128)))
    assert _train(other, tmp_path / "run", "--resume") == 2
    assert "holds another model than --config (differs in ffn_hidden)" in capsys.readouterr().err


def test_a_bpe_run_keeps_its_tokenizer_where_sample_finds_it(
    quick_config: Config, tmp_path: Path, capsys, caplog
):
    """Else `sample` would train the BPE again from the run's corpus, at every call."""
    config = replace(quick_config, "data", tokenizer="bpe", bpe_vocab_size=300)
    config_file = tmp_path / "bpe.toml"
    config_file.write_text(dump_config(config))
    run = tmp_path / "bpe"
    assert _train(config_file, run, "--max-steps", "1") == 0
    assert (run / "checkpoints" / "tokenizer.json").is_file()
    capsys.readouterr()
    caplog.set_level(logging.INFO)
    assert main(["sample", "--from", str(run), "--prompt", PROMPT, "--tokens", "4"]) == 0
    assert capsys.readouterr().out.startswith(PROMPT)
    assert "rebuilding" not in caplog.text
