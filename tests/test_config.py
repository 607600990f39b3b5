"""Run configs: every file in configs/ loads; each kind of mistake names the key and the file."""

from pathlib import Path

import pytest

from hetnode.cli.main import EXIT_USAGE, main
from hetnode.config import Config, dump_config, load_config, replace
from hetnode.errors import ConfigError
from hetnode.model import count_parameters

CONFIG_DIR = Path(__file__).resolve().parents[1] / "configs"

CONFIGS = sorted(Path(__file__).resolve().parents[1].joinpath("configs").glob("*.toml"))


def test_configs_folder_has_the_named_scales():
    assert {p.stem for p in CONFIGS} >= {"tiny", "small", "178m", "1b"}


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_every_config_loads(path: Path):
    config = load_config(path)
    assert isinstance(config, Config)
    assert config.run.name == path.stem


@pytest.mark.parametrize(
    ("name", "low", "high"),
    [("tiny", 0.7e6, 1.3e6), ("small", 8e6, 13e6), ("178m", 160e6, 200e6), ("1b", 0.9e9, 1.2e9)],
)
def test_config_scales(name: str, low: float, high: float):
    config = load_config(CONFIGS[0].parent / f"{name}.toml")
    assert low <= count_parameters(config.model) <= high


def _write(tmp_path: Path, body: str) -> Path:
    path = tmp_path / "bad.toml"
    path.write_text(body)
    return path


@pytest.mark.parametrize(
    ("body", "key", "words"),
    [
        ("[model]\nd_modle = 128\n", "model.d_modle", "unknown key"),
        ("[modle]\nd_model = 128\n", "modle", "unknown key"),
        ("[model]\nd_model = '128'\n", "model.d_model", "expected int"),
        ("[model]\nd_model = 1.5\n", "model.d_model", "expected int"),
        ("[model]\ntie_embeddings = 1\n", "model.tie_embeddings", "expected bool"),
        ("[inner]\nlr = true\n", "inner.lr", "expected float"),
        ("[inner]\nlr = -0.1\n", "inner.lr", "must be > 0"),
        ("[model]\nd_model = 130\nn_heads = 4\n", "model.d_model", "divisible"),
        ("[data]\nseq_len = 512\n", "data.seq_len", "max_seq_len"),
        ("[data]\ntokenizer = 'words'\n", "data.tokenizer", "must be one of"),
        ("[outer]\ntile = 128\n", "outer.tile", "12-bit"),
        ("[outer]\ntopk = 0\n", "outer.topk", "must be in"),
        ("[outer]\nerror_feedback = 1.0\n", "outer.error_feedback", "[0, 1)"),
        ("[outer]\ncheckpoint_every_rounds = 0\n", "outer.checkpoint_every_rounds", ">= 1"),
        ("[outer]\nkeep_checkpoints = 0\n", "outer.keep_checkpoints", ">= 1"),
        ("[outer]\nverify_sample = 0\n", "outer.verify_sample", ">= 1"),
        ("[outer]\nverify_min_chance = 0.0\n", "outer.verify_min_chance", "(0, 1]"),
        ("[outer]\nprobation_rounds = 0\n", "outer.probation_rounds", "[1, 1024]"),
        ("[outer]\naggregation = 'median'\n", "outer.aggregation", "must be one of"),
        ("[outer]\nbudget_quantile = 0.0\n", "outer.budget_quantile", "(0, 1]"),
        ("[outer]\nbudget_quantile = nan\n", "outer.budget_quantile", "(0, 1]"),
        ("[pipeline]\nstages = 9\n", "pipeline.stages", "every stage needs a layer"),
        ("[pipeline]\ncompression = 'some'\n", "pipeline.compression", "must be one of"),
        ("[network]\nrecord_ttl_s = 1.0\n", "network.record_ttl_s", "heartbeat"),
        ("[network]\nstable_heartbeat_s = 0.5\n", "network.stable_heartbeat_s", "slower one"),
        ("[data]\nsource = 'http://example'\n", "data.source", "wiki"),
        ("[samples]\ntokens = 257\n", "samples.tokens", "[0, 256]"),
        ("[samples]\ntokens = -1\n", "samples.tokens", "0: no samples"),
        ("[samples]\ntemperature = nan\n", "samples.temperature", "[0, 10]"),
        ("[samples]\nprompt = ' '\n", "samples.prompt", "not be empty"),
        (f"[samples]\nprompt = '{'x' * 201}'\n", "samples.prompt", "at most 200"),
        ("model = 3\n", "model", "expected a table"),
        ("[model\n", "<file>", "not valid TOML"),
    ],
)
def test_bad_config_names_the_key(tmp_path: Path, body: str, key: str, words: str):
    path = _write(tmp_path, body)
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert info.value.key == key
    assert str(path) in str(info.value)
    assert words in str(info.value)


def test_missing_file_is_a_config_error(tmp_path: Path):
    with pytest.raises(ConfigError, match="no such file"):
        load_config(tmp_path / "nope.toml")


def test_cli_exits_2_on_bad_config(tmp_path: Path, capsys):
    path = _write(tmp_path, "[train]\nmax_steps = 0\n")
    assert main(["train", "--config", str(path), "--out", str(tmp_path / "out")]) == EXIT_USAGE
    err = capsys.readouterr().err
    assert "train.max_steps" in err and str(path) in err


@pytest.mark.parametrize("name", ["tiny", "small", "178m", "1b"])
def test_dump_config_reads_back_equal(name, tmp_path):
    config = replace(load_config(CONFIG_DIR / f"{name}.toml"), "data", data_dir='C:\\odd "dir"')
    path = tmp_path / "dumped.toml"
    path.write_text(dump_config(config))
    assert load_config(path) == config
