"""The coordinator's checkpoints (`bootstrap/checkpoint_store.py` over `hetnode/replica/checkpoint.py`):
saved and read back whole, the newest K kept, a damaged newest one passed over for the one before it,
another config's refused by name, `--resume` with nothing to resume, an old `global.pt` converted once,
and the newest one served over HTTP."""

from __future__ import annotations

import copy
import functools
import json
import logging
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from bootstrap.checkpoint_store import (
    ROUND_HEADER,
    CheckpointRoutes,
    NothingToResume,
    checkpoints_root,
    convert_legacy,
    restore,
    store,
)
from bootstrap.run_state import (
    CHECKPOINT,
    CONVERTED,
    STATE_FILE,
    RunMismatch,
    check_stored_run,
    checkpoint_shapes,
    model_shapes,
    new_run_state,
)
from hetnode.config import Config, replace
from hetnode.errors import CheckpointError
from hetnode.model.shards import layer_digests
from hetnode.replica.checkpoint import (
    MANIFEST,
    WEIGHTS,
    CheckpointManifest,
    folder_name,
    latest_checkpoint,
    list_checkpoints,
    load_checkpoint,
    save_checkpoint,
)
from hetnode.replica.global_model import GlobalModel
from hetnode.service.datadir import DataDir
from hetnode.service.http_server import HttpServer

RUN = "tiny-0123abcd"


@functools.cache
def seeded(config: Config) -> GlobalModel:
    return GlobalModel(config)  # a second to build: once per config


def theta_at(config: Config, round_: int) -> GlobalModel:
    """The seeded θ, moved by `round_` so that each round's θ differs."""
    model = copy.deepcopy(seeded(config))
    with torch.no_grad():
        for tensor in model.params.values():
            tensor.add_(0.001 * round_)
    model.params_round, model.seal_hash = round_, f"seal-{round_}"
    model.changed()
    return model


def store_rounds(folder: Path, config: Config, rounds: list[int]) -> dict[int, dict[str, str]]:
    """A coordinator's checkpoints after these rounds; each round's layer digests."""
    digests = {}
    for round_ in rounds:
        model = theta_at(config, round_)
        store(checkpoints_root(folder), model, config, RUN)
        digests[round_] = model.digests()
    return digests


def snapshot(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def test_a_checkpoint_reads_back_whole_and_the_newest_is_found(tmp_path, tiny_config):
    root = tmp_path / "checkpoints"
    assert latest_checkpoint(root) is None and list_checkpoints(root) == []
    for round_ in (-1, 12, 3):
        model = theta_at(tiny_config, round_)
        manifest = CheckpointManifest.of(tiny_config, round_, model.seal_hash, model.digests(), RUN)
        save_checkpoint(root / folder_name(round_), model.params, manifest)
    assert [(r, f.name) for r, f in list_checkpoints(root)] == [
        (-1, "round-init"),
        (3, "round-000003"),
        (12, "round-000012"),
    ]
    assert latest_checkpoint(root) == root / "round-000012"
    params, manifest = load_checkpoint(root / "round-000012")
    assert manifest.round == 12 and manifest.run == RUN and manifest.seal_hash == "seal-12"
    assert manifest.config == tiny_config.to_dict()
    assert layer_digests(params) == theta_at(tiny_config, 12).digests() == manifest.layer_digests
    assert checkpoint_shapes(root / "round-000012") == model_shapes(tiny_config)  # the header alone


def test_the_newest_k_are_kept_and_an_unchanged_theta_is_not_rewritten(tmp_path, tiny_config):
    config = replace(tiny_config, "outer", keep_checkpoints=2)
    root = checkpoints_root(tmp_path)
    (root / "round-000001.tmp").mkdir(parents=True)  # what a crash in the middle of a save leaves
    store_rounds(tmp_path, config, [-1, 2, 4, 6])
    assert [r for r, _ in list_checkpoints(root)] == [4, 6]
    assert sorted(p.name for p in root.iterdir()) == ["round-000004", "round-000006"]
    before = snapshot(root)
    assert store(root, theta_at(config, 6), config, RUN) is None  # a stop right after a checkpoint
    assert snapshot(root) == before


@pytest.mark.parametrize("damage", ["bad safetensors", "digest mismatch", "not finite", "bad manifest"])
def test_a_damaged_newest_checkpoint_falls_back_to_the_one_before(tmp_path, tiny_config, damage, caplog):
    digests = store_rounds(tmp_path, tiny_config, [2, 4])
    newest = checkpoints_root(tmp_path) / "round-000004"
    params, _ = load_checkpoint(newest)
    name = next(iter(params))
    if damage == "bad safetensors":
        (newest / WEIGHTS).write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not a header}")
    elif damage == "digest mismatch":  # a valid file whose bytes the manifest's digests do not describe
        params[name][0] += 1.0
        save_file(params, str(newest / WEIGHTS))
    elif damage == "not finite":
        params[name][0] = float("nan")
        save_file(params, str(newest / WEIGHTS))
    else:
        (newest / MANIFEST).write_text("{")
    with caplog.at_level(logging.WARNING):
        restored = restore(tmp_path, tiny_config, RUN, resume=True)
    assert restored is not None and restored.manifest.round == 2
    assert layer_digests(restored.params) == digests[2]
    assert "passing over damaged checkpoint" in caplog.text and "round-000004" in caplog.text
    # set aside for a person to look at: neither restored, served nor counted again
    assert (checkpoints_root(tmp_path) / "round-000004.damaged").is_dir()
    assert latest_checkpoint(checkpoints_root(tmp_path)).name == "round-000002"


def test_every_checkpoint_damaged_is_an_error_that_changes_nothing(tmp_path, tiny_config):
    store_rounds(tmp_path, tiny_config, [2, 4])
    for _, folder in list_checkpoints(checkpoints_root(tmp_path)):
        (folder / WEIGHTS).write_bytes(b"junk")
    before = snapshot(tmp_path)
    for resume in (True, False):  # without --resume too: never a silent start from the seeded θ
        with pytest.raises(CheckpointError) as refused:
            restore(tmp_path, tiny_config, RUN, resume=resume)
        assert f"no checkpoint in {checkpoints_root(tmp_path)} is usable" in str(refused.value)
        assert "round-000004" in str(refused.value) and "backup" in str(refused.value)
        assert snapshot(tmp_path) == before


def test_another_configs_or_runs_checkpoint_is_refused_by_name(tmp_path, tiny_config):
    store_rounds(tmp_path, tiny_config, [2])
    before = snapshot(tmp_path)
    for other, named in [
        (replace(tiny_config, "model", d_model=64), "model.d_model"),
        (replace(tiny_config, "run", seed=7), "run.seed 0 -> 7"),
        (replace(tiny_config, "data", source="bin:/srv/tokens.bin"), "data.source"),
    ]:
        with pytest.raises(RunMismatch) as refused:
            restore(tmp_path, other, RUN, resume=True)
        message = str(refused.value)
        assert "round-000002 is not θ of this run" in message and named in message, message
        assert "Nothing was changed" in message and "--new-run" in message
    with pytest.raises(RunMismatch, match="written by run tiny-0123abcd, and the data dir holds run x"):
        restore(tmp_path, tiny_config, "x")
    assert snapshot(tmp_path) == before
    # settings that do not change what θ means may differ between two starts of a run
    timing = replace(tiny_config, "network", boundary_s=tiny_config.network.boundary_s + 5)
    assert restore(tmp_path, timing, RUN, resume=True).manifest.round == 2


def test_resume_needs_a_checkpoint(tmp_path, tiny_config):
    assert restore(tmp_path, tiny_config, RUN) is None  # a start without --resume begins from θ⁰
    with pytest.raises(NothingToResume) as refused:
        restore(tmp_path, tiny_config, RUN, resume=True)
    message = str(refused.value)
    assert f"data dir {tmp_path} holds no checkpoint" in message and "without --resume" in message
    assert list(tmp_path.iterdir()) == []


def test_an_old_global_pt_is_converted_once(tmp_path, tiny_config):
    """A data dir of an earlier version: the coordinator's torch.save pickle, with its run state."""
    (tmp_path / STATE_FILE).write_text(json.dumps(new_run_state(tiny_config) | {"run": RUN}))
    old = theta_at(tiny_config, 3)
    torch.save({"params_round": 3, "seal_hash": "seal-3", "params": old.params}, tmp_path / CHECKPOINT)
    with DataDir(tmp_path) as data_dir:  # the run check still reads the old file's shapes
        assert check_stored_run(data_dir, tiny_config, Path("tiny.toml")).state["run"] == RUN
    folder = convert_legacy(tmp_path, tiny_config, RUN)
    assert folder == checkpoints_root(tmp_path) / "round-000003"
    assert not (tmp_path / CHECKPOINT).exists() and (tmp_path / CONVERTED).is_file()
    restored = restore(tmp_path, tiny_config, RUN, resume=True)
    assert restored.manifest.round == 3 and restored.manifest.seal_hash == "seal-3"
    assert restored.manifest.run == RUN and layer_digests(restored.params) == old.digests()
    assert convert_legacy(tmp_path, tiny_config, RUN) is None  # once


def test_an_old_checkpoint_that_is_not_plain_tensors_is_refused_unread(tmp_path, tiny_config):
    torch.save({"params_round": 3, "params": {"x": Path("/")}}, tmp_path / CHECKPOINT)  # needs code to load
    before = snapshot(tmp_path)
    with pytest.raises(CheckpointError, match="unreadable: it holds objects other than tensors.*Nothing was"):
        convert_legacy(tmp_path, tiny_config, RUN)
    assert snapshot(tmp_path) == before
    params = {name: torch.full(shape, float("inf")) for name, shape in model_shapes(tiny_config).items()}
    torch.save({"params_round": 3, "seal_hash": None, "params": params}, tmp_path / CHECKPOINT)
    with pytest.raises(CheckpointError, match="not finite float32"):
        convert_legacy(tmp_path, tiny_config, RUN)
    assert not checkpoints_root(tmp_path).exists() and (tmp_path / CHECKPOINT).exists()


def test_the_run_check_reads_the_newest_checkpoints_shapes(tmp_path, tiny_config):
    other = replace(tiny_config, "model", d_model=64)
    (tmp_path / STATE_FILE).write_text(json.dumps(new_run_state(tiny_config) | {"run": RUN}))
    model = theta_at(other, 5)
    manifest = CheckpointManifest.of(tiny_config, 5, "s", model.digests(), RUN)  # a manifest that lies
    save_checkpoint(checkpoints_root(tmp_path) / folder_name(5), model.params, manifest)
    with DataDir(tmp_path) as data_dir, pytest.raises(RunMismatch) as refused:
        check_stored_run(data_dir, tiny_config, Path("tiny.toml"))
    assert "checkpoints/round-000005 holds another model" in str(refused.value)


def fetch(url: str) -> tuple[int, dict[str, str], bytes]:
    try:
        with urllib.request.urlopen(url, timeout=10) as response:
            return response.status, dict(response.headers), response.read()
    except urllib.error.HTTPError as error:
        return error.code, dict(error.headers), error.read()


def test_the_newest_checkpoint_is_served_as_load_checkpoint_reads_it(tmp_path, tiny_config):
    root = checkpoints_root(tmp_path / "boot")
    server = HttpServer("127.0.0.1", 0, CheckpointRoutes(root).routes())
    server.start()
    try:
        for name in ("manifest.json", "model.safetensors"):
            status, headers, body = fetch(f"{server.url}/api/checkpoint/{name}")
            assert status == 404 and headers["Content-Type"] == "application/json"
            assert "no checkpoint yet" in json.loads(body)["error"]
        digests = store_rounds(tmp_path / "boot", tiny_config, [2, 4])
        got = tmp_path / "got"
        got.mkdir()
        for name in ("manifest.json", "model.safetensors"):
            status, headers, body = fetch(f"{server.url}/api/checkpoint/{name}")
            assert status == 200 and headers[ROUND_HEADER] == "4"
            size = (root / "round-000004" / name).stat().st_size
            assert int(headers["Content-Length"]) == len(body) == size
            (got / name).write_bytes(body)
        params, manifest = load_checkpoint(got)
        assert manifest.round == 4 and layer_digests(params) == digests[4]
    finally:
        server.stop()
