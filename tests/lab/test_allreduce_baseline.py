"""The hivemind all-reduce baseline as the benchmark runs it: three real processes on 127.0.0.1.

Each instance runs in its own session, so whatever it spawns (the averager, the DHT, `p2pd`) can be
found by session id afterwards (nothing may be left) and killed as one group if the test fails.
"""

import contextlib
import json
import os
import select
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import SimpleNamespace

import pytest
from hivemind import DHT

from hetnode.lab.netbench import allreduce_baseline as baseline
from hetnode.lab.netbench.allreduce_baseline import tensor_sizes, theory_bytes_per_peer

ROOT = Path(__file__).resolve().parents[2]
GROUP = 3
NUMEL = 200_000
ROUNDS = 2
READY_TIMEOUT_S = 30
ATTEMPTS = 3
# two rounds, each allowed a failed attempt (a stalled hivemind all-reduce gives up after ~25 s)
EXIT_TIMEOUT_S = 120


def _session_members(sid: int) -> list[int]:
    """Live processes in session `sid` (field 6 of /proc/PID/stat, counted after the command name)."""
    members = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue  # exited while we looked
        fields = stat.rpartition(")")[2].split()
        if fields[0] != "Z" and int(fields[3]) == sid:
            members.append(int(entry.name))
    return members


def _start(index: int, tmp_path: Path, initial_peer: str | None) -> subprocess.Popen:
    """Instance `index`, its JSON and stderr in tmp_path (a file: a full stderr pipe would block it)."""
    out = tmp_path / f"{index}.json"
    cmd = [sys.executable, "-m", "hetnode.lab.netbench.allreduce_baseline", "--index", str(index)]
    cmd += ["--group-size", str(GROUP), "--numel", str(NUMEL), "--rounds", str(ROUNDS)]
    cmd += [
        "--attempts",
        str(ATTEMPTS),
        "--interface",
        "lo",
        "--timeout",
        "20",
        "--barrier-timeout",
        "40",
        "--out",
        str(out),
    ]
    if initial_peer is not None:
        cmd += ["--initial-peer", initial_peer]
    # one torch thread each: three instances share a small machine
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    with (tmp_path / f"{index}.log").open("w") as log:  # the child keeps its own descriptor
        return subprocess.Popen(
            cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=log, text=True, start_new_session=True
        )


def _stderr(tmp_path: Path, index: int) -> str:
    return (tmp_path / f"{index}.log").read_text()[-3000:]


def _read_ready(proc: subprocess.Popen, tmp_path: Path) -> str:
    """The first multiaddr of the READY line (stdout is line-buffered by the module's flush)."""
    deadline = time.monotonic() + READY_TIMEOUT_S
    while (left := deadline - time.monotonic()) > 0:
        # select first: a bare readline would wait forever on an instance that hangs before READY
        if not select.select([proc.stdout], [], [], left)[0]:
            break
        line = proc.stdout.readline()
        if line.startswith("READY "):
            return line.split()[1]
        if not line and proc.poll() is not None:
            break
    proc.kill()
    pytest.fail(f"first instance never printed READY; stderr:\n{_stderr(tmp_path, 0)}")


def test_tensor_sizes_and_theory():
    for numel in (1024, 200_000, 123_456_789):
        sizes = tensor_sizes(numel)
        assert sum(sizes) == numel and min(sizes) > 0
    assert theory_bytes_per_peer(1000, 4) == 2 * 3 / 4 * 1000 * 2


@pytest.mark.slow
def test_three_instances_average_together(tmp_path):
    procs: list[subprocess.Popen] = []
    try:
        procs.append(_start(0, tmp_path, None))
        maddr = _read_ready(procs[0], tmp_path)
        assert maddr.startswith("/ip4/127.0.0.1/tcp/") and "/p2p/" in maddr
        for index in range(1, GROUP):
            procs.append(_start(index, tmp_path, maddr))

        deadline = time.monotonic() + EXIT_TIMEOUT_S
        for index, proc in enumerate(procs):
            try:
                proc.communicate(timeout=max(1.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pytest.fail(
                    f"instance {index} did not exit in {EXIT_TIMEOUT_S}s:\n{_stderr(tmp_path, index)}"
                )
            assert proc.returncode == 0, (
                f"instance {index} exited {proc.returncode}:\n{_stderr(tmp_path, index)}"
            )

        for index in range(GROUP):
            report = json.loads((tmp_path / f"{index}.json").read_text())
            assert report["numel"] == NUMEL and report["group_size"] == GROUP
            assert report["theory_bytes_per_peer"] == pytest.approx(2 * (GROUP - 1) / GROUP * NUMEL * 2)
            assert len(report["rounds"]) == ROUNDS
            for round_no, result in enumerate(report["rounds"]):
                assert result["round"] == round_no
                assert result["ok"] is True, result
                # a retried round says why its earlier attempts failed
                assert len(result["failed_attempts"]) == result["attempt"] < ATTEMPTS
                assert result["group_size_seen"] == GROUP
                assert result["peer_indexes"] == list(range(GROUP))
                assert result["seconds"] > 0
                # loopback carries at least this instance's own share of the butterfly
                assert result["tx_bytes"] > 0 and result["rx_bytes"] > 0

        # clean shutdown: no p2pd (or any other child) outlives its instance
        leftovers: dict[int, list[int]] = {}
        for _ in range(50):
            leftovers = {p.pid: m for p in procs if (m := _session_members(p.pid))}
            if not leftovers:
                break
            time.sleep(0.1)
        assert not leftovers, f"processes left behind: {leftovers}"
    finally:
        for proc in procs:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)  # the session this test created for the instance
            proc.wait()


def test_peers_retry_a_round_together_when_one_got_a_wrong_mean(monkeypatch):
    """Agreement after each attempt over a real DHT of two peers: one wrong mean makes both retry."""

    def fake_round(averager, args, sizes, round_no, attempt=0):
        # peer 1's first attempt comes back off the mean; everything else is right
        ok = not (args.index == 1 and attempt == 0)
        error = None if ok else "averaged tensors are off the mean by up to 3.3900"
        return baseline.RoundResult(round=round_no, seconds=0.1, ok=ok, error=error, attempt=attempt)

    monkeypatch.setattr(baseline, "run_round", fake_round)
    first = DHT(host_maddrs=["/ip4/127.0.0.1/tcp/0"], start=True)
    second = DHT(
        initial_peers=[str(m) for m in first.get_visible_maddrs()],
        host_maddrs=["/ip4/127.0.0.1/tcp/0"],
        start=True,
    )
    try:

        def play(index: int, dht: DHT) -> baseline.RoundResult:
            args = SimpleNamespace(index=index, count=2, attempts=3, barrier_timeout=20.0)
            return baseline.run_agreed_round(SimpleNamespace(dht=dht), args, [], 0)

        with ThreadPoolExecutor(2) as pool:
            results = list(pool.map(play, (0, 1), (first, second)))
    finally:
        second.shutdown()
        first.shutdown()
    for result in results:
        assert result.ok and result.attempt == 1  # both went again, and the second attempt stood
        assert len(result.failed_attempts) == 1
    # the peer that was right still records why its first attempt did not count
    assert "peers [1]" in results[0].failed_attempts[0]
    assert "off the mean" in results[1].failed_attempts[0]
