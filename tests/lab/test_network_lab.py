"""The network lab (namespaces, bridge, tc) moves bytes at the shaped rate, and the network benchmark's
summary computes its ratios from round logs the way BENCHMARKS.md says."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from hetnode.lab.netlab.hosts import NetLab, parse_net_dev
from hetnode.lab.netlab.link_trace import CLOCK_TICKS, LinkTrace, LinkTracer
from hetnode.lab.netlab.sync_windows import round_windows, window_cores, window_cpu, window_load
from hetnode.lab.runs.network_plan import NetworkPlan
from hetnode.lab.runs.network_report import critical_sync_s, stage_times, summarise_swarm

NEEDS_ROOT = pytest.mark.skipif(
    os.geteuid() != 0 or not shutil.which("ip") or not shutil.which("tc"),
    reason="needs root with `ip` and `tc`",
)

NET_DEV = "\n".join(  # /proc/net/dev: two header lines, then "name: 8 rx counters 8 tx counters"
    [
        "Inter-|   Receive |  Transmit",
        " face |bytes packets errs drop fifo frame compressed multicast|bytes packets ...",
        "    lo: 120 2 0 0 0 0 0 0 120 2 0 0 0 0 0 0",
        "e0abcd: 5000000 3500 0 0 0 0 0 0 2000000 1700 0 0 0 0 0 0",
    ]
)


def test_interface_counters_are_read_from_proc_net_dev():
    assert parse_net_dev(NET_DEV, "e0abcd") == (5_000_000, 2_000_000)
    assert parse_net_dev(NET_DEV, "lo") == (120, 120)
    with pytest.raises(Exception, match="no interface"):
        parse_net_dev(NET_DEV, "eth9")


def test_a_link_trace_interpolates_between_samples_and_a_window_reads_its_links_share():
    trace = LinkTrace(
        [100.0, 101.0, 102.0],
        [
            {"a": (0, 0), "s": (0, 0)},
            {"a": (1000, 0), "s": (250_000, 10)},
            {"a": (1000, 0), "s": (500_000, 20)},
        ],
    )
    assert trace.bytes_between("s", 100.5, 101.5) == (250_000, 10)
    assert trace.bytes_between("a", 99.0, 103.0) == (1000, 0)  # clamped to the trace
    assert trace.rates_mbit("s", 100.0, 102.0, 1.0) == [(2.0, 0.00008), (2.0, 0.00008)]
    assert trace.core_busy("cpu0", 100.0, 101.0) is None  # no cores sampled
    trace.cores = [{"cpu0": (0, 0)}, {"cpu0": (50, 100)}, {"cpu0": (150, 200)}]
    assert trace.core_busy("cpu0", 100.0, 101.0) == 0.5 and trace.core_busy("cpu0", 101.0, 102.0) == 1.0
    assert window_cores(trace, {1: {"announced": 100.0, "sealed": 101.0, "fetched": 102.0}}) == {
        "sealing": {"cpu0": 0.5},
        "fetching": {"cpu0": 1.0},
    }
    ticks = CLOCK_TICKS  # a daemon (pid 7) and its p2pd (pid 9): one second of CPU each, in the second second
    trace.processes = [{7: (1, 0)}, {7: (1, 0), 9: (7, 0)}, {7: (1, ticks), 9: (7, ticks)}]
    assert trace.children_of(7) == {9} and trace.cpu_seconds(7, 101.0, 102.0) == pytest.approx(1.0)
    cpu = window_cpu(trace, {1: {"announced": 100.0, "sealed": 101.0, "fetched": 102.0}}, {"anchor": 7})
    assert cpu["sealing"]["anchor"] == {"seconds": 1.0, "daemon_s": 0.0, "p2pd_s": 0.0}
    assert cpu["fetching"]["anchor"] == {"seconds": 1.0, "daemon_s": 1.0, "p2pd_s": 1.0}
    logs = {  # the seal reached the first replica at 100.5, the last fetched at 101.5
        "a": [{"round": 3, "included": True, "time": 99.0, "seal_wait_s": 1.6, "fetch_s": 0.9}],
        "s": [{"round": 3, "included": True, "time": 99.5, "seal_wait_s": 1.0, "fetch_s": 1.0}],
    }
    windows = round_windows(logs, [3])
    assert windows == {3: {"announced": 99.5, "sealed": 100.5, "fetched": 101.5}}
    load = window_load(trace, windows, {"a": 8.0, "s": 2.0})
    assert load["fetching"]["s"]["up_share"] == pytest.approx(1.0)  # 250 KB in 1 s fills 2 Mbit/s
    assert load["fetching"]["a"]["up_bytes"] == pytest.approx(500)


def _stage_log(round_: int, train_s: float, sync: tuple[float, float], included: bool = True) -> dict:
    return {
        "round": round_,
        "role": "stage",
        "train_s": train_s,
        "tokens": 2048,
        "upload_bytes": 250_000,
        "download_bytes": 1_000_000,
        "seal_wait_s": sync[0],
        "apply_s": sync[1],
        "included": included,
        "activation_bytes_sent": 600_000,
        "activation_bytes_received": 600_000,
        "tokens_per_s": 2048 / train_s,
    }


def test_swarm_summary_ratios_follow_their_definitions():
    plan = NetworkPlan(inner_steps=10, chain_rounds=2, allreduce_rounds=1, slow_mbit=20.0)
    anchor = {**_stage_log(1, 1.0, (0.5, 0.1)), "role": "anchor", "tokens_per_s": 4000.0}
    run = {
        "peer_ids": {"stage-1": "s1", "stage-2": "s2"},
        "history": [
            {"round": 1, "contributors": ["a", "s1", "s2"], "time": 100.0, "eval_loss": 5.0},
            {"round": 2, "contributors": ["a"], "time": 104.0, "eval_loss": 4.0},
        ],
        "round_logs": {
            "anchor-1": [anchor],
            "anchor-2": [anchor],
            "stage-1": [_stage_log(1, 2.0, (0.4, 0.1)), _stage_log(2, 2.0, (0.4, 0.1), included=False)],
            "stage-2": [_stage_log(1, 4.0, (0.4, 0.1)), _stage_log(2, 1.0, (0.4, 0.1), included=False)],
        },
        "wire_bytes": {"coordinator": {"rx": 100, "tx": 300}},
    }
    summary = summarise_swarm(run, plan)
    assert summary["rounds_with_chain"] == 1 and summary["round_wall_s"] == 4.0
    assert summary["chain_tokens_per_s"] == pytest.approx((2048 / 4.0 + 2048 / 2.0) / 2)  # the slower stage
    limit = 1_250_000 / (20e6 / 8)  # up + down bytes at 20 Mbit/s
    assert summary["stage_sync"]["physical_limit_s"] == pytest.approx(limit)
    assert summary["stage_sync"]["sync_over_limit"] == pytest.approx(0.5 / limit)  # included rounds only
    assert summary["wire_bytes_per_round"]["coordinator"] == 200


def test_critical_sync_starts_at_the_last_announcement_of_the_round():
    def log(round_, announced, wait, apply, included=True):
        return {
            "round": round_,
            "time": announced,
            "seal_wait_s": wait,
            "apply_s": apply,
            "included": included,
        }

    logs = {
        "anchor-1": [log(1, 100.0, 3.0, 0.2)],  # announced last: the seal could not come before 103 - 0.0
        "anchor-2": [log(1, 90.0, 1.0, 0.1, included=False)],  # not in the seal: does not count
        "stage-1": [log(1, 95.0, 8.5, 0.4)],  # waited 8.5 s, most of it for anchor-1's training
        "stage-2": [log(1, 96.0, 7.5, 0.3), log(2, 110.0, 1.0, 0.2, included=False)],
    }
    assert critical_sync_s(logs) == pytest.approx([3.9, 3.8])


@pytest.mark.slow
@NEEDS_ROOT
def test_a_shaped_lab_link_moves_bytes_at_its_rate():
    payload = 2_500_000  # 1 s at 20 Mbit/s
    server = (
        "import socket,sys\n"
        "s=socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)\n"
        "s.bind((sys.argv[1], 9700)); s.listen(1); print('up', flush=True); c,_=s.accept(); n=0\n"
        "while True:\n    b=c.recv(1<<16)\n    n+=len(b)\n    if not b: break\n"
        "print(n, flush=True)\n"
    )
    client = (
        "import socket,sys,time\n"
        "s=socket.create_connection((sys.argv[1], 9700)); t=time.perf_counter()\n"
        f"s.sendall(b'x'*{payload}); s.shutdown(socket.SHUT_WR); s.recv(1); print(time.perf_counter()-t)\n"
    )
    with NetLab({"fast": None, "slow": 20.0}) as lab, LinkTracer(lab.hub, lab.hub_devices, 0.1) as trace:
        fast, slow = lab.hosts["fast"], lab.hosts["slow"]
        before = lab.interface_bytes("slow")
        receiver = subprocess.Popen(
            [*fast.prefix, sys.executable, "-c", server, fast.address], stdout=subprocess.PIPE, text=True
        )
        try:
            assert receiver.stdout.readline().strip() == "up"
            started = time.perf_counter()
            subprocess.run(
                [*slow.prefix, sys.executable, "-c", client, fast.address],
                check=True,
                timeout=30,
                capture_output=True,
            )
            seconds = time.perf_counter() - started
            ended = time.time()
            assert int(receiver.stdout.readline()) == payload
            time.sleep(0.3)  # a sample after the transfer
        finally:
            receiver.kill()
            receiver.wait(10)
        sent = lab.interface_bytes("slow")[1] - before[1]
    rate_mbit = payload * 8 / seconds / 1e6
    assert 12.0 < rate_mbit < 22.0, f"{rate_mbit:.1f} Mbit/s over a 20 Mbit/s lab link"
    assert sent >= payload  # the counters see the bytes (and the headers)
    # the hub-side trace sees the same upload, and the fast host's download of it
    up, _ = trace.bytes_between("slow", ended - seconds - 1.0, ended + 0.3)
    _, down = trace.bytes_between("fast", ended - seconds - 1.0, ended + 0.3)
    assert payload <= up <= 1.1 * payload and payload <= down <= 1.1 * payload
    peak = max(r[0] for r in trace.rates_mbit("slow", trace.times[0], trace.times[-1], 0.5))
    assert 12.0 < peak < 22.0
    assert trace.core_names() and all(  # every core of the machine, each busy a share of the time
        0.0 <= (trace.core_busy(core, trace.times[0], trace.times[-1]) or 0.0) <= 1.0
        for core in trace.core_names()
    )
    assert trace.children_of(os.getpid())  # the receiver, a python this test started, with its CPU time
    assert not any(
        lab.hub in line
        for line in subprocess.run(
            ["ip", "netns", "list"], capture_output=True, text=True
        ).stdout.splitlines()
    )


def test_baseline_rounds_with_a_wrong_result_are_not_timed(tmp_path: Path):
    from hetnode.lab.runs.network import ok_allreduce_rounds

    result = tmp_path / "stage-1.json"
    good = {"round": 0, "seconds": 16.6, "ok": True}
    result.write_text(json.dumps({"rounds": [good, {"round": 1, "seconds": 21.0, "ok": False}]}))
    assert ok_allreduce_rounds(result) == [good]
    result.write_text("{not json")
    assert ok_allreduce_rounds(result) == []
    assert ok_allreduce_rounds(tmp_path / "missing.json") == []


def test_a_stage_is_link_bound_when_its_frames_need_longer_at_the_link_rate_than_its_passes():
    rounds = [
        {"steps": 10, "compute_s": 1.0, "send_s": 4.0, "activation_bytes_sent": 5_000_000},
        {"steps": 10, "compute_s": 1.2, "send_s": 4.4, "activation_bytes_sent": 5_000_000},
        {"steps": 10, "compute_s": None, "send_s": None, "activation_bytes_sent": 1},  # an older log line
    ]
    times = stage_times(rounds, rate_bytes_per_s=1e6)  # 8 Mbit/s
    assert times["compute_s"] == 0.11 and round(times["send_s"], 6) == 0.42
    assert times["link_s"] == 0.5 > times["compute_s"]  # 500 KB per micro-batch at 1 MB/s
