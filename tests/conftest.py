"""Shared fixtures: the tiny config with a per-session data cache (nothing is written to ~)."""

from pathlib import Path

import pytest

from hetnode.config import Config, load_config, replace

CONFIG_DIR = Path(__file__).resolve().parents[1] / "configs"


@pytest.fixture(scope="session")
def data_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("hetnode-data")


@pytest.fixture(scope="session")
def tiny_config(data_dir: Path) -> Config:
    return replace(load_config(CONFIG_DIR / "tiny.toml"), "data", data_dir=str(data_dir))
