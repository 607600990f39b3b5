"""A trainer state as safetensors: what goes in comes out, keys keep their type, damage is refused."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from hetnode.errors import CheckpointError
from hetnode.training.state_file import load_state, save_state


def test_a_nested_state_comes_back_as_it_was(tmp_path: Path):
    shared = torch.randn(3, 4)
    state = {
        "optimizer": {
            "state": {0: {"step": torch.tensor(5.0), "exp_avg": torch.randn(2, 2)}, 1: {}},
            "param_groups": [{"lr": 1e-3, "betas": (0.9, 0.95), "params": [0, 1], "foreach": None}],
        },
        "tied": [shared, shared],  # one storage twice: safetensors alone refuses it
        "step": 7,
        "loss": math.inf,
        "name": "run",
        "empty": torch.zeros(0, 4, dtype=torch.bfloat16),
    }
    save_state(tmp_path / "s.safetensors", state)
    got = load_state(tmp_path / "s.safetensors")
    assert list(got["optimizer"]["state"]) == [0, 1]  # ints, as `Optimizer.load_state_dict` matches them
    assert torch.equal(got["optimizer"]["state"][0]["exp_avg"], state["optimizer"]["state"][0]["exp_avg"])
    assert got["optimizer"]["state"][0]["step"].shape == ()
    assert got["optimizer"]["param_groups"] == [
        {"lr": 1e-3, "betas": [0.9, 0.95], "params": [0, 1], "foreach": None}
    ]
    assert all(torch.equal(t, shared) for t in got["tied"])
    assert (got["step"], got["loss"], got["name"]) == (7, math.inf, "run")
    assert got["empty"].dtype == torch.bfloat16 and got["empty"].shape == (0, 4)
    assert not (tmp_path / "s.safetensors.tmp").exists()


def test_what_is_not_a_state_file_is_refused(tmp_path: Path):
    with pytest.raises(CheckpointError, match="missing"):
        load_state(tmp_path / "absent.safetensors")
    (tmp_path / "junk").write_bytes(b"not safetensors")
    with pytest.raises(CheckpointError, match="unreadable"):
        load_state(tmp_path / "junk")
    from safetensors.torch import save_file

    save_file({"x": torch.zeros(1)}, str(tmp_path / "model.safetensors"))
    with pytest.raises(CheckpointError, match="not a hetnode-state/1 file"):
        load_state(tmp_path / "model.safetensors")
    with pytest.raises(TypeError, match="state.x"):
        save_state(tmp_path / "s", {"x": object()})
