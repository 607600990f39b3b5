"""A coordinator restarted on its data dir with another config (real processes, loopback): it refuses with
nothing on disk changed, so the right config brings back the same run; `--new-run` starts a new run in that
data dir, the old run's files moved aside. `--resume` goes on from the latest checkpoint, which the
coordinator also serves over HTTP."""

from __future__ import annotations

import json
import urllib.request
from pathlib import Path

import pytest
import torch

from hetnode.config import dump_config, load_config, replace
from hetnode.model.shards import layer_digests
from hetnode.replica.checkpoint import CheckpointManifest, load_checkpoint, save_checkpoint

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
    theta = "checkpoints/round-init/model.safetensors"  # θ⁰, written on stop
    assert {"coordinator.json", theta, "identity.key"} <= set(before)

    refused = swarm.bootstrap(wrong, data_dir=data_dir)
    assert refused.proc.wait(90) == 2  # a config error: a restart would be refused again
    message = refused.tail()
    assert refused.ready is None
    assert f"holds run {ready['run']} (config 'tiny')" in message, message
    assert "run.name 'tiny' -> 'other'" in message and "Nothing was changed" in message, message
    assert "--data-dir" in message and "--new-run" in message, message
    assert "starting a new run" not in message  # the old behaviour: a new run id, then the refusal
    assert snapshot(data_dir) == before  # byte for byte: coordinator.json, θ, the ledger, the key

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
    for name in ("coordinator.json", theta, "ledger.sqlite"):
        assert (aside / name).read_bytes() == old_run[name], name  # moved, never rewritten
    assert fresh.stop() == 0

    # the new run is the data dir's run now: its config goes on with it, the old one is refused
    assert json.loads((data_dir / "coordinator.json").read_text())["run"] == started["run"]
    back = swarm.bootstrap(right, data_dir=data_dir)
    assert back.proc.wait(90) == 2
    assert f"holds run {started['run']} (config 'other')" in back.tail()


def get(url: str) -> bytes:
    with urllib.request.urlopen(url, timeout=10) as response:
        return response.read()


def test_resume_goes_on_from_the_latest_checkpoint_and_serves_it(swarm, tmp_path):
    path = swarm.config()
    config = load_config(path)
    data_dir = tmp_path / "coordinator"

    nothing = swarm.bootstrap(path, data_dir=data_dir, extra=["--resume"])
    assert nothing.proc.wait(90) == 2
    message = nothing.tail()
    assert f"data dir {data_dir} holds no checkpoint" in message and "without --resume" in message, message
    assert not (data_dir / "identity.key").exists()  # refused before anything was written

    first = swarm.bootstrap(path, data_dir=data_dir)
    run = first.wait_ready()["run"]
    assert first.stop() == 0
    # θ after round 7, as the coordinator writes it after sealing: the seeded θ, moved
    params, _ = load_checkpoint(data_dir / "checkpoints" / "round-init")
    params = {name: tensor + 0.01 for name, tensor in params.items()}
    digests = layer_digests(params)
    manifest = CheckpointManifest.of(config, 7, "seal-7", digests, run)
    save_checkpoint(data_dir / "checkpoints" / "round-000007", params, manifest)

    again = swarm.bootstrap(path, data_dir=data_dir, extra=["--resume"])
    http = again.wait_ready()["http"]
    assert json.loads(get(f"{http}/api/status"))["params_round"] == 7
    served = tmp_path / "served"
    served.mkdir()
    for name in ("manifest.json", "model.safetensors"):
        (served / name).write_bytes(get(f"{http}/api/checkpoint/{name}"))
    got, got_manifest = load_checkpoint(served)
    assert got_manifest.round == 7 and got_manifest.run == run and layer_digests(got) == digests
    assert again.stop() == 0
    # its θ on stop is the checkpoint's, bit for bit: the newest checkpoint was not rewritten
    _, on_disk = load_checkpoint(data_dir / "checkpoints" / "round-000007")
    assert on_disk == manifest and torch.equal(got[next(iter(got))], params[next(iter(params))])
