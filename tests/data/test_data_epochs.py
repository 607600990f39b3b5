"""The epoch guard (train.max_epochs): training refuses data its steps would repeat too often, says how
many tokens it has and needs and how to override; `--allow-repeats` lifts it on `hetnode train` and `join`."""

from pathlib import Path

import pytest

from hetnode.cli.main import EXIT_USAGE, build_parser, main
from hetnode.config import dump_config, load_config, replace
from hetnode.daemon.swarm import local_config
from hetnode.data import TokenDataset, check_epochs, training_dataset
from hetnode.errors import ConfigError

CONFIG_DIR = Path(__file__).resolve().parents[2] / "configs"


def tiny_needs(config) -> int:
    return config.train.max_steps * config.data.batch_size * config.data.seq_len


def test_tiny_trains_when_its_data_covers_max_epochs(tiny_config):
    assert tiny_config.train.max_epochs == 0.0  # off by default: the CPU configs train on the bundled corpus
    config = replace(tiny_config, "train", max_epochs=1.0)
    dataset = training_dataset(config)
    assert dataset.train_tokens >= tiny_needs(config)  # 300 x 16 x 128 = 614,400 bytes: one pass is enough


def test_tiny_refuses_a_limit_its_data_cannot_meet(tiny_config):
    config = replace(tiny_config, "train", max_epochs=0.01)  # at most 1 % of a pass: needs 61 M tokens
    with pytest.raises(ConfigError) as caught:
        training_dataset(config)
    err = caught.value
    assert err.key == "train.max_epochs"
    on_hand = TokenDataset.build(config.data, config.model.vocab_size, config.run.seed).train_tokens
    needed = tiny_needs(config) * 100
    assert f"{on_hand:,} training tokens on hand" in err.message and f"need {needed:,}" in err.message
    assert "--allow-repeats" in err.message and "train.max_epochs = 0" in err.message


def test_the_guard_counts_the_steps_a_run_will_take(tiny_config):
    config = replace(tiny_config, "train", max_epochs=4.0)
    tokens = tiny_needs(config) // 4
    check_epochs(config, tokens)  # exactly four passes: allowed
    with pytest.raises(ConfigError, match="train.max_epochs"):
        check_epochs(config, tokens - 1)
    check_epochs(config, tokens - 1, max_steps=config.train.max_steps - 1)  # `--max-steps` fewer
    check_epochs(replace(config, "train", max_epochs=0.0), 0)  # 0: off


@pytest.mark.parametrize("name", ["178m", "1b"])
def test_gpu_configs_refuse_the_bundled_corpus(name):
    config = load_config(CONFIG_DIR / f"{name}.toml")
    assert config.train.max_epochs == 4.0
    with pytest.raises(ConfigError, match=r"1,100,000 training tokens on hand"):
        check_epochs(config, 1_100_000)  # the demo corpus in 16k BPE tokens: hundreds of epochs


@pytest.mark.parametrize("bad", [-1.0, float("nan"), float("inf")])
def test_max_epochs_must_be_a_sane_number(tiny_config, bad):
    with pytest.raises(ConfigError, match="train.max_epochs"):
        replace(tiny_config, "train", max_epochs=bad)


def test_hetnode_train_refuses_and_allow_repeats_overrides(tiny_config, tmp_path: Path, capsys):
    path = tmp_path / "guarded.toml"
    # 2 steps x 16 x 128 at most 1e-6 epochs need 4.1 G tokens: refused even for a short run
    path.write_text(dump_config(replace(tiny_config, "train", max_epochs=1e-6)))
    out = tmp_path / "run"
    argv = ["train", "--config", str(path), "--out", str(out), "--no-progress", "--max-steps", "2"]
    assert main(argv) == EXIT_USAGE
    err = capsys.readouterr().err
    assert "config error" in err and "train.max_epochs" in err and "--allow-repeats" in err
    assert not (out / "metrics.jsonl").exists()  # refused before any step
    assert main([*argv, "--allow-repeats"]) == 0
    assert len((out / "metrics.jsonl").read_text().splitlines()) >= 2


def test_join_allow_repeats_lifts_the_guard_for_this_volunteer_only(tiny_config):
    manifest = replace(tiny_config, "train", max_epochs=4.0)
    assert local_config(manifest, None, "/tmp/cache").train.max_epochs == 4.0
    mine = local_config(manifest, None, "/tmp/cache", allow_repeats=True)
    assert mine.train.max_epochs == 0.0 and mine.model == manifest.model and mine.outer == manifest.outer
    args = build_parser().parse_args(["join", "--peer", "http://127.0.0.1:8400", "--allow-repeats"])
    assert args.allow_repeats is True
