"""What made `hetnode sample` slow, held without timing (the timings are benchmarks/sample_speed.py's):
checking a checkpoint's shapes built the model on the meta device, and torch's first meta-device
initialiser imports its compiler (`torch._dynamo`), a second or more at every call (issue 33, item 9)."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import pytest

from hetnode.export.hf import expected_shapes
from hetnode.model.decoder import parameter_shapes

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("tied", [False, True])
def test_the_shapes_from_the_config_are_the_models(tiny_config, tied: bool):
    cfg = dataclasses.replace(tiny_config.model, tie_embeddings=tied, n_layers=3)
    assert expected_shapes(cfg) == parameter_shapes(cfg)


def test_sampling_loads_no_compiler(small, write_checkpoint):
    folder = write_checkpoint(small("selective", tied=False))
    argv = ["sample", "--from", str(folder), "--prompt", "The river", "--tokens", "4"]
    script = (
        "import json, sys; from hetnode.cli.main import main; code = main(sys.argv[1:]); "
        "print(json.dumps([code, sorted(m for m in sys.modules if m.startswith('torch._dynamo'))]))"
    )
    done = subprocess.run(
        [sys.executable, "-c", script, *argv], capture_output=True, text=True, timeout=120, cwd=ROOT
    )
    assert done.returncode == 0, done.stderr
    code, compiler = json.loads(done.stdout.strip().splitlines()[-1])
    assert code == 0 and compiler == [], done.stderr
