"""A coordinator restarted on its data dir with another config (real processes, loopback): it refuses with
nothing on disk changed, so the right config brings back the same run; `--new-run` starts a new run in that
data dir, the old run's files moved aside."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from hetnode.config import dump_config, load_config, replace

pytestmark = pytest.mark.slow


def snapshot(folder: Path) -> dict[str, bytes]:
    """Every file's bytes, but the lock (it holds the pid of whoever opened the data dir last)."""
    return {
        str(p.relative_to(folder)): p.read_bytes()
        for p in sorted(folder.rglob("*"))
        if p.is_file() and p.name != "daemon.lock"
    }


def test_a_wrong_config_changes_nothing_and_new_run_moves_the_old_run_aside(swarm, tmp_path):
    right = swarm.config()
    wrong = tmp_path / "other.toml"  # another run: its name and its model differ
    other = replace(replace(load_config(right), "run", name="other"), "model", d_model=64)
    wrong.write_text(dump_config(other))
    data_dir = tmp_path / "coordinator"

    first = swarm.bootstrap(right, data_dir=data_dir)
    ready = first.wait_ready()
    assert first.stop() == 0
    before = snapshot(data_dir)
    assert {"coordinator.json", "global.pt", "identity.key"} <= set(before)

    refused = swarm.bootstrap(wrong, data_dir=data_dir)
    assert refused.proc.wait(90) == 1
    message = refused.tail()
    assert refused.ready is None
    assert f"holds run {ready['run']} (config 'tiny')" in message, message
    assert "run.name 'tiny' -> 'other'" in message and "Nothing was changed" in message, message
    assert "--data-dir" in message and "--new-run" in message, message
    assert "starting a new run" not in message  # the old behaviour: a new run id, then the refusal
    assert snapshot(data_dir) == before  # byte for byte: coordinator.json, global.pt, the ledger, the key

    again = swarm.bootstrap(right, data_dir=data_dir)
    restarted = again.wait_ready()
    assert restarted["run"] == ready["run"] and restarted["peer_id"] == ready["peer_id"]
    assert again.stop() == 0
    old_run = snapshot(data_dir)

    fresh = swarm.bootstrap(wrong, data_dir=data_dir, extra=["--new-run"])
    started = fresh.wait_ready()
    assert started["run"] != ready["run"] and started["run"].startswith("other-")
    assert started["peer_id"] == ready["peer_id"] and started["maddrs"] == ready["maddrs"]  # same address
    assert "moved into" in fresh.tail(300)
    [aside] = (data_dir / "previous-runs").iterdir()
    assert aside.name.endswith(f"-{ready['run']}")
    assert json.loads((aside / "coordinator.json").read_text())["run"] == ready["run"]
    for name in ("coordinator.json", "global.pt", "ledger.sqlite"):
        assert (aside / name).read_bytes() == old_run[name], name  # moved, never rewritten
    assert fresh.stop() == 0

    # the new run is the data dir's run now: its config goes on with it, the old one is refused
    assert json.loads((data_dir / "coordinator.json").read_text())["run"] == started["run"]
    back = swarm.bootstrap(right, data_dir=data_dir)
    assert back.proc.wait(90) == 1
    assert f"holds run {started['run']} (config 'other')" in back.tail()
