"""The coordinator's run check (`bootstrap/run_state.py`): a config that does not continue the stored run
is refused with nothing on disk changed; `--new-run` moves the old run aside, keeping the coordinator's own
files (identity, admissions) and address."""

from __future__ import annotations

import json
import sqlite3
from pathlib import Path

import pytest
import torch

from bootstrap.run_state import (
    CHECKPOINT,
    HISTORY,
    LEDGER_FILE,
    NEIGHBOURS_FILE,
    PREVIOUS_RUNS,
    STATE_FILE,
    RunMismatch,
    begin_new_run,
    check_stored_run,
    go_on_with_run,
    model_shapes,
    new_run_state,
    shape_mismatch,
)
from hetnode.config import Config, replace
from hetnode.replica.global_model import GlobalModel
from hetnode.service.datadir import DataDir

CONFIG_PATH = Path("configs/tiny.toml")


def save_checkpoint(path: Path, config: Config) -> None:
    params = {name: torch.zeros(shape) for name, shape in model_shapes(config).items()}
    torch.save({"params_round": 3, "seal_hash": None, "params": params}, path)


def a_run(folder: Path, config: Config) -> dict:
    """A data dir as a coordinator of `config` leaves it after a few rounds; its state."""
    folder.mkdir(parents=True, exist_ok=True)
    state = new_run_state(config) | {"listen_requested": "/ip4/127.0.0.1/tcp/0", "listen_port": 40123}
    (folder / STATE_FILE).write_text(json.dumps(state, indent=1, sort_keys=True))
    save_checkpoint(folder / CHECKPOINT, config)
    (folder / HISTORY).write_text(json.dumps({"round": 3}) + "\n")
    (folder / NEIGHBOURS_FILE).write_text(json.dumps({"maddrs": ["/ip4/127.0.0.1/tcp/1/p2p/QmX"]}))
    with sqlite3.connect(folder / LEDGER_FILE) as ledger:
        ledger.execute("CREATE TABLE contributions (round INTEGER)")
        ledger.execute("PRAGMA user_version = 2")
    (folder / "identity.key").write_text("key")
    (folder / "admissions.json").write_text("{}")
    return state


def snapshot(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def refusal(folder: Path, config: Config) -> str:
    """The refusal's message; the data dir must be byte-identical afterwards."""
    before = snapshot(folder)
    with DataDir(folder) as data_dir, pytest.raises(RunMismatch) as refused:
        go_on_with_run(data_dir, config, CONFIG_PATH)
    after = snapshot(folder)
    after.pop("daemon.lock", None)
    before.pop("daemon.lock", None)
    assert after == before
    return str(refused.value)


def test_an_empty_data_dir_begins_a_run_and_writes_nothing(tmp_path, tiny_config):
    with DataDir(tmp_path / "boot") as data_dir:
        state = go_on_with_run(data_dir, tiny_config, CONFIG_PATH)
    assert state["run"].startswith("tiny-") and state["config"] == tiny_config.to_dict()
    assert sorted(p.name for p in (tmp_path / "boot").iterdir()) == ["daemon.lock"]


def test_the_same_config_goes_on_with_the_stored_run(tmp_path, tiny_config):
    stored = a_run(tmp_path / "boot", tiny_config)
    with DataDir(tmp_path / "boot") as data_dir:
        state = go_on_with_run(data_dir, tiny_config, CONFIG_PATH)
    assert state["run"] == stored["run"] and state["created"] == stored["created"]
    assert state["listen_port"] == 40123


@pytest.mark.parametrize(
    ("section", "changes", "named"),
    [
        ("run", {"name": "small"}, "run.name 'tiny' -> 'small'"),
        ("run", {"seed": 7}, "run.seed 0 -> 7"),
        ("model", {"d_model": 64}, "global.pt holds another model: blocks.0.attn.wk.weight is 128x128"),
        ("model", {"n_layers": 5}, "global.pt holds another model: "),
        ("pipeline", {"compression": "none"}, "pipeline.compression 'selective' -> 'none'"),
    ],
)
def test_a_config_that_does_not_continue_the_run_is_refused_and_nothing_changes(
    tmp_path, tiny_config, section, changes, named
):
    stored = a_run(tmp_path / "boot", tiny_config)
    message = refusal(tmp_path / "boot", replace(tiny_config, section, **changes))
    assert named in message
    assert f"holds run {stored['run']} (config 'tiny')" in message
    assert "Nothing was changed" in message
    assert "--data-dir" in message and "--new-run" in message
    assert str(tmp_path / "boot" / PREVIOUS_RUNS) in message
    # after the refusal the right config still finds the same run
    with DataDir(tmp_path / "boot") as data_dir:
        assert go_on_with_run(data_dir, tiny_config, CONFIG_PATH)["run"] == stored["run"]


def test_an_older_state_file_is_checked_by_its_config_name_and_the_checkpoint(tmp_path, tiny_config):
    folder = tmp_path / "boot"
    a_run(folder, tiny_config)
    old = json.loads((folder / STATE_FILE).read_text())
    del old["config"]  # written before the state file kept the config
    (folder / STATE_FILE).write_text(json.dumps(old))
    assert "run.name 'tiny' -> 'small'" in refusal(folder, replace(tiny_config, "run", name="small"))
    assert "holds another model" in refusal(folder, replace(tiny_config, "model", d_model=64))
    with DataDir(folder) as data_dir:
        assert go_on_with_run(data_dir, tiny_config, CONFIG_PATH)["run"] == old["run"]


def test_other_settings_may_change_and_are_reported(tmp_path, tiny_config):
    stored = a_run(tmp_path / "boot", tiny_config)
    changed = replace(tiny_config, "network", boundary_s=tiny_config.network.boundary_s + 5)
    changed = replace(changed, "pipeline", compression="everything")  # another subspace mode: same T_fix
    with DataDir(tmp_path / "boot") as data_dir:
        check = check_stored_run(data_dir, changed, CONFIG_PATH)
        state = go_on_with_run(data_dir, changed, CONFIG_PATH)
    b = tiny_config.network.boundary_s
    assert check.changed == {
        "network.boundary_s": (b, b + 5),
        "pipeline.compression": ("selective", "everything"),
    }
    assert state["run"] == stored["run"] and state["config"]["network"]["boundary_s"] == b + 5


def test_a_setting_the_stored_config_lacks_is_no_difference(tmp_path, tiny_config):
    """A setting added by an upgrade of hetnode must not refuse every run made before it."""
    folder = tmp_path / "boot"
    stored = a_run(folder, tiny_config)
    state = json.loads((folder / STATE_FILE).read_text())
    del state["config"]["model"]["norm_eps"]
    (folder / STATE_FILE).write_text(json.dumps(state))
    with DataDir(folder) as data_dir:
        assert check_stored_run(data_dir, tiny_config, CONFIG_PATH).state["run"] == stored["run"]


def test_run_files_without_a_state_file_are_refused(tmp_path, tiny_config):
    folder = tmp_path / "boot"
    a_run(folder, tiny_config)
    (folder / STATE_FILE).unlink()
    message = refusal(folder, tiny_config)
    assert f"{CHECKPOINT}, {HISTORY}, {LEDGER_FILE}" in message and f"no {STATE_FILE}" in message
    assert "--new-run" in message


def test_a_damaged_state_checkpoint_or_ledger_is_refused_with_its_fix(tmp_path, tiny_config):
    folder = tmp_path / "boot"
    stored = a_run(folder, tiny_config)
    (folder / STATE_FILE).write_text(json.dumps({"created": 1.0}))
    assert f"{folder / STATE_FILE} names no run id" in refusal(folder, tiny_config)
    (folder / STATE_FILE).write_text(json.dumps(stored))

    (folder / CHECKPOINT).write_bytes(b"not a checkpoint")
    message = refusal(folder, tiny_config)
    assert f"{folder / CHECKPOINT} is unreadable" in message and "Restore it from a backup" in message

    save_checkpoint(folder / CHECKPOINT, tiny_config)
    with sqlite3.connect(folder / LEDGER_FILE) as ledger:
        ledger.execute("PRAGMA user_version = 99")
    message = refusal(folder, tiny_config)
    assert "schema version 99, newer than" in message and "Upgrade hetnode" in message

    (folder / LEDGER_FILE).write_bytes(b"x" * 200)
    assert "is not a SQLite database" in refusal(folder, tiny_config)


def test_new_run_moves_the_old_run_aside_and_keeps_the_coordinators_files(tmp_path, tiny_config):
    folder = tmp_path / "boot"
    old = a_run(folder, tiny_config)
    before = snapshot(folder)
    other = replace(tiny_config, "run", name="small")
    with DataDir(folder) as data_dir:
        state = begin_new_run(data_dir, other)
    assert state["run"].startswith("small-") and state["run"] != old["run"]
    assert state["listen_port"] == 40123  # same address
    assert json.loads((folder / STATE_FILE).read_text()) == state  # written at once
    [aside] = (folder / PREVIOUS_RUNS).iterdir()
    assert aside.name.endswith(f"-{old['run']}")
    moved = {STATE_FILE, CHECKPOINT, HISTORY, LEDGER_FILE, NEIGHBOURS_FILE}
    assert {p.name for p in aside.iterdir()} == moved
    for name in moved:
        assert (aside / name).read_bytes() == before[name]  # moved, not rewritten
    for name in ("identity.key", "admissions.json"):
        assert (folder / name).read_bytes() == before[name]
    assert not any((folder / name).exists() for name in moved - {STATE_FILE})
    with DataDir(folder) as data_dir:  # the next start goes on with the new run
        assert go_on_with_run(data_dir, other, CONFIG_PATH)["run"] == state["run"]


def test_new_run_twice_and_on_an_empty_data_dir(tmp_path, tiny_config):
    folder = tmp_path / "boot"
    with DataDir(folder) as data_dir:
        first = begin_new_run(data_dir, tiny_config)  # nothing to move aside
        assert not (folder / PREVIOUS_RUNS).exists()
        second = begin_new_run(data_dir, tiny_config)
        third = begin_new_run(data_dir, tiny_config)  # within the same second: a folder of its own
    assert len({first["run"], second["run"], third["run"]}) == 3
    folders = sorted((folder / PREVIOUS_RUNS).iterdir())
    assert len(folders) == 2
    assert {json.loads((f / STATE_FILE).read_text())["run"] for f in folders} == {first["run"], second["run"]}


def test_model_shapes_are_the_global_models(tiny_config):
    """The check reads the config's shapes off the meta device: exactly what the coordinator's θ holds."""
    for config in (tiny_config, replace(tiny_config, "model", tie_embeddings=True, n_layers=2)):
        held = {name: tuple(t.shape) for name, t in GlobalModel(config).params.items()}
        assert model_shapes(config) == held


def test_shape_mismatch_names_the_first_difference():
    expected = {"a": (2, 3), "b": (4,)}
    assert shape_mismatch(dict(expected), expected) is None
    assert shape_mismatch({"a": (2, 3)}, expected) == "1 tensors where the config's model has 2 (no b)"
    assert "an extra c" in shape_mismatch(expected | {"c": (1,)}, expected)
    transposed = {"a": (3, 2), "b": (4,)}
    assert shape_mismatch(transposed, expected) == "a is 3x2 there and 2x3 in the config's model"


def test_write_json_is_atomic_and_move_aside_of_nothing_makes_no_folder(tmp_path):
    with DataDir(tmp_path) as data_dir:
        data_dir.write_json("state.json", {"a": 1})
        data_dir.write_json("state.json", {"a": 2})
        assert data_dir.read_json("state.json") == {"a": 2}
        assert data_dir.move_aside(["absent.json"], "aside") == []
    assert sorted(p.name for p in tmp_path.iterdir()) == ["daemon.lock", "state.json"]
