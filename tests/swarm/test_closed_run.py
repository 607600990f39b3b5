"""A closed run (`bootstrap --admit tokens`) with real processes: a volunteer with a join token trains;
one without, or with a token another key already spent, is refused with the reason; an unadmitted
attacker that announces well-formed contributions is never heard."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
HETNODE = [sys.executable, "-m", "hetnode.cli.main"]


def join_once(name: str, maddr: str, data_dir: Path, *extra: str) -> subprocess.CompletedProcess:
    args = [*HETNODE, "join", "--peer", maddr, "--name", name, "--bandwidth", "1000"]
    args += ["--listen", "/ip4/127.0.0.1/tcp/0", "--data-dir", str(data_dir), "--connect-timeout", "20"]
    return subprocess.run([*args, *extra], capture_output=True, text=True, timeout=120, cwd=ROOT)


def test_a_closed_run_hears_only_admitted_peers(swarm, tmp_path):
    config = swarm.config(outer={"inner_steps": 8})
    boot = swarm.bootstrap(config, extra=["--admit", "tokens"])
    boot.wait_ready()
    issued = subprocess.run(
        [*HETNODE, "bootstrap", "token", "--name", "alice", "--data-dir", str(tmp_path / "bootstrap")],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT,
    )
    assert issued.returncode == 0, issued.stderr
    token = issued.stdout.strip()
    alice = swarm.join("alice", boot.maddr, "1000", extra=["--token", token])
    alice.wait_ready()

    stranger = join_once("stranger", boot.maddr, tmp_path / "stranger")
    assert stranger.returncode != 0 and "did not admit" in stranger.stderr, stranger.stderr[-1500:]
    thief = join_once("thief", boot.maddr, tmp_path / "thief", "--token", token)
    assert thief.returncode != 0 and "already used" in thief.stderr, thief.stderr[-1500:]

    swarm.wait_for_round(1, timeout=120)
    attack = subprocess.run(
        [
            sys.executable,
            str(ROOT / "tests" / "swarm" / "attacker.py"),
            "ledger",
            "--peer",
            boot.maddr,
            "--seconds",
            "10",
        ],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
    )
    result = json.loads(
        next(line for line in attack.stdout.splitlines() if line.startswith("RESULT ")).split(" ", 1)[1]
    )
    assert result["announcements_accepted"] >= 1  # the DHT stored them: the run's members ignore them
    since = swarm.history()[-1]["round"]
    history = swarm.wait_for_round(since + 2, timeout=120)
    attacker = result["peer_id"]
    assert not any(attacker in h["contributors"] or attacker in h["excluded"] for h in history)
    assert all(h["contributors"] == [alice.peer_id] for h in history)
    document = swarm.status(boot.maddr)
    assert {p["name"] for p in document["peers"]} == {"coordinator", "alice"}
