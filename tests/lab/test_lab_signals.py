"""A lab command stopped mid-run, by Ctrl+C (SIGINT to its process group, as a terminal sends it) or by
SIGTERM (to it alone, as `kill` or a CI runner sends it), exits within seconds and leaves no daemon,
`p2pd`, namespace or link behind. Real `hetnode bench network --quick` runs in the netns lab (root)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from hetnode.lab.netlab.hosts import lab_namespaces, lab_unavailable, stray_links
from hetnode.lab.proctree import alive, descendants

NEEDS_ROOT = pytest.mark.skipif(bool(lab_unavailable()), reason=lab_unavailable())
STARTED = "coordinator up; starting"  # bench network's progress line once the lab and coordinator are up
STOP_WITHIN_S = 15.0  # a shared 5 s grace for the replicas, 2.5 s for the coordinator, then the namespaces


def _lab_tag(line: str) -> str:
    # "[bench network] lab 1a2b3c: coordinator up; starting anchor-1, ..."
    return line.split(" lab ", 1)[1].split(":", 1)[0]


@NEEDS_ROOT
@pytest.mark.slow
@pytest.mark.parametrize("how", ["ctrl-c", "sigterm"])
def test_bench_network_stopped_mid_run_leaves_nothing_behind(tmp_path: Path, how: str) -> None:
    bench = subprocess.Popen(
        [sys.executable, "-m", "hetnode.cli.main", "bench", "network", "--quick", "--out", str(tmp_path)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,  # its own process group, as a terminal's foreground job
    )
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(iter(bench.stdout.readline, "")), daemon=True)
    reader.start()
    try:
        deadline = time.monotonic() + 240
        while not any(STARTED in line for line in lines) and time.monotonic() < deadline:
            assert bench.poll() is None, "".join(lines)[-3000:]
            time.sleep(0.2)
        assert any(STARTED in line for line in lines), "".join(lines)[-3000:]
        tag = _lab_tag(next(line for line in lines if STARTED in line))
        # mid-run: every daemon up, each with its p2pd (coordinator + 4 peers, each under `ip netns exec`)
        while len([p for p in descendants(bench.pid) if alive(p)]) < 10 and time.monotonic() < deadline:
            time.sleep(0.5)
        time.sleep(3.0)
        running = [p for p in descendants(bench.pid) if alive(p)]
        assert len(running) >= 10, "".join(lines)[-3000:]
        assert lab_namespaces(tag)
        signalled = time.monotonic()
        if how == "ctrl-c":
            os.killpg(bench.pid, signal.SIGINT)
        else:
            bench.send_signal(signal.SIGTERM)
        bench.wait(STOP_WITHIN_S + 30)
        took = time.monotonic() - signalled
    finally:
        if bench.poll() is None:
            os.killpg(bench.pid, signal.SIGKILL)
            bench.wait(10)
    output = "".join(lines)
    assert took <= STOP_WITHIN_S, f"stopping took {took:.1f} s:\n{output[-3000:]}"
    assert bench.returncode != 0  # an interrupted bench does not claim a result
    assert not [p for p in running if alive(p)], output[-3000:]  # no daemon, no p2pd
    assert not lab_namespaces(tag) and not stray_links(tag)
    assert not (tmp_path / "network.json").exists()
