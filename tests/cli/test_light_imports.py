"""`hetnode --help` answers at once: building the parser loads no torch, hivemind or matplotlib (each
subcommand imports those inside its handler). Timings live in benchmarks/cli_speed.py, not here: this
holds the cause, which does not depend on how busy the machine is."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
HEAVY = ("torch", "hivemind", "matplotlib")
LOADED = "import json, sys; print(json.dumps(sorted(m for m in sys.modules if m.split('.')[0] in {0!r})))"


def heavy_modules_after(statement: str) -> list[str]:
    """The torch, hivemind and matplotlib modules a fresh interpreter has loaded after `statement`."""
    script = f"{statement}; {LOADED.format(HEAVY)}"
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120, cwd=ROOT
    )
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_importing_the_cli_loads_no_torch_hivemind_or_matplotlib():
    assert heavy_modules_after("import hetnode.cli.main") == []


def test_building_every_parser_loads_none_either():
    assert heavy_modules_after("from hetnode.cli.main import build_parser; build_parser()") == []
