"""`hetnode bench wan-check`: the lab's WAN emulator measured against what it was asked for.

One lab: an unemulated "core" host and one host per profile. Through each emulated link, in turn: a UDP
echo (RTT and the loss each way, from sequence numbers the echo server counts) and TCP bulk transfers
down and up (steady rate, after slow start). tc's rate counts whole frames, so one TCP flow's payload
can reach at most 1448 / 1514 = 0.956 of it. How far loss holds TCP below that depends on the kernel's
congestion control (recorded: BBR here, which barely slows for random loss; CUBIC would).
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from hetnode.errors import HetnodeError
from hetnode.lab.guard import interruptible, lab_session
from hetnode.lab.netlab.hosts import Host, NetLab
from hetnode.lab.netlab.wan import PRESETS, LinkProfile

CHECKED = ("home-cable", "dsl", "mobile", "far")
ECHO_PORT, BULK_PORT = 9801, 9802
PROBE_GAP_S = 0.005  # 2000 probes in 10 s: enough to tell 0.5 % loss from none
GOODPUT_SHARE = 1448 / 1514  # TCP payload per full Ethernet frame (timestamps on), what tbf counts

# the echo server: echoes each probe, counts distinct sequence numbers, exits after `idle` quiet seconds
ECHO_SERVER = """
import os, socket, sys
try: os.sched_setscheduler(0, os.SCHED_RR, os.sched_param(1))  # the probe's own scheduling is no link delay
except OSError: pass
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM); s.bind((sys.argv[1], int(sys.argv[2])))
print("up", flush=True); seen = set(); s.settimeout(float(sys.argv[3]))
while True:
    try: data, peer = s.recvfrom(2048)
    except socket.timeout: break
    s.sendto(data, peer); s.settimeout(float(sys.argv[4]))
    if data[:8] != bytes(8): seen.add(data[:8])
print(len(seen), flush=True)
"""
# the echo client: a warm-up probe (seq 0) until one returns, so that ARP is resolved; then probes 1..n
# `gap` s apart; then waits `tail` s for the last echoes. Prints the RTT per seq.
ECHO_CLIENT = """
import json, os, socket, sys, time
try: os.sched_setscheduler(0, os.SCHED_RR, os.sched_param(1))
except OSError: pass
host, port, n = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
gap, tail = float(sys.argv[4]), float(sys.argv[5])
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM); s.settimeout(tail)
for _ in range(10):
    s.sendto(bytes(64), (host, port))
    try: s.recvfrom(2048); break
    except socket.timeout: pass
s.setblocking(False); sent = {}; rtt = {}; start = time.perf_counter(); i = 0
while True:
    now = time.perf_counter()
    if i < n and now >= start + i * gap:
        sent[i + 1] = now; s.sendto((i + 1).to_bytes(8, "big") + b"x" * 56, (host, port)); i += 1
    try:
        data, _ = s.recvfrom(2048); seq = int.from_bytes(data[:8], "big")
        if seq: rtt.setdefault(seq, time.perf_counter() - sent[seq])
    except BlockingIOError:
        if i >= n and now > start + n * gap + tail: break
        time.sleep(0.0005)
print(json.dumps({"sent": n, "rtt_s": {str(k): v for k, v in rtt.items()}}))
"""
# bulk TCP: the receiver samples (seconds, bytes so far) every 0.1 s until EOF; the sender sends for T s
BULK_RECEIVER = """
import json, socket, sys, time
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind((sys.argv[1], int(sys.argv[2]))); s.listen(1); print("up", flush=True)
c, _ = s.accept(); start = time.perf_counter(); n = 0; samples = [[0.0, 0]]; c.settimeout(30)
while True:
    b = c.recv(1 << 18)
    if not b: break
    n += len(b); now = time.perf_counter() - start
    if now - samples[-1][0] >= 0.1: samples.append([now, n])
samples.append([time.perf_counter() - start, n]); print(json.dumps(samples), flush=True)
"""
BULK_SENDER = """
import socket, sys, time
s = socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=30)
end = time.perf_counter() + float(sys.argv[3])
chunk = b"x" * (1 << 16)
while time.perf_counter() < end: s.sendall(chunk)
s.close()
"""


def _spawn(host: Host, script: str, *args: object) -> subprocess.Popen[str]:
    argv = [*host.prefix, sys.executable, "-c", script, *map(str, args)]
    return subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _first_line(proc: subprocess.Popen[str], timeout: float) -> str:
    assert proc.stdout is not None
    line = proc.stdout.readline().strip()
    if not line:
        proc.kill()
        err = proc.stderr.read() if proc.stderr else ""
        raise HetnodeError(f"a probe in the lab failed: {err.strip()[-1000:]}")
    return line


def echo(client: Host, server: Host, count: int, gap_s: float, tail_s: float) -> dict[str, Any]:
    """UDP probes client -> server -> client: RTT per probe and the loss each way."""
    srv = _spawn(server, ECHO_SERVER, server.address, ECHO_PORT, 10 + count * gap_s + tail_s, tail_s)
    try:
        _first_line(srv, 10)
        cli = _spawn(client, ECHO_CLIENT, server.address, ECHO_PORT, count, gap_s, tail_s)
        out = json.loads(_first_line(cli, 30 + count * gap_s + tail_s))
        cli.wait(10)
        received = int(_first_line(srv, 30))  # printed once the client has been quiet for tail_s
    finally:
        srv.kill()
        srv.wait(10)
    rtts = {int(seq): rtt for seq, rtt in out["rtt_s"].items()}
    return echo_summary(count, received, rtts)


def echo_summary(sent: int, received_by_server: int, rtts: dict[int, float]) -> dict[str, Any]:
    """RTT statistics (in ms) and the loss each way, from probes numbered 1..sent."""
    ms = sorted(rtt * 1000 for rtt in rtts.values())
    up_loss = 1 - received_by_server / sent
    down_loss = 1 - len(rtts) / received_by_server if received_by_server else 1.0
    return {
        "probes": sent,
        "rtt_ms_mean": statistics.fmean(ms) if ms else None,
        "rtt_ms_p50": ms[len(ms) // 2] if ms else None,
        "rtt_ms_p95": ms[min(len(ms) - 1, int(0.95 * len(ms)))] if ms else None,
        "rtt_ms_stdev": statistics.stdev(ms) if len(ms) > 1 else None,
        "loss_up": up_loss,
        "loss_down": down_loss,
    }


def bulk(sender: Host, receiver: Host, seconds: float, warm_s: float) -> dict[str, float]:
    """TCP sender -> receiver for `seconds`: the steady rate after `warm_s` and the whole run's."""
    rcv = _spawn(receiver, BULK_RECEIVER, receiver.address, BULK_PORT)
    try:
        _first_line(rcv, 10)
        snd = _spawn(sender, BULK_SENDER, receiver.address, BULK_PORT, seconds)
        samples = json.loads(_first_line(rcv, seconds + 40))
        snd.wait(30)
    finally:
        rcv.kill()
        rcv.wait(10)
    return steady_rate(samples, warm_s)


def steady_rate(samples: list[list[float]], warm_s: float) -> dict[str, float]:
    """Mbit/s over the samples after `warm_s` (slow start excluded), and over all of them."""
    end_t, end_n = samples[-1]
    warm = next((s for s in samples if s[0] >= warm_s), samples[0])
    steady = (end_n - warm[1]) * 8 / max(end_t - warm[0], 1e-9) / 1e6
    return {"mbit_steady": steady, "mbit_overall": end_n * 8 / max(end_t, 1e-9) / 1e6, "bytes": end_n}


def check_profile(lab: NetLab, name: str, seconds: float, probes: int) -> dict[str, Any]:
    host, core = lab.hosts[name], lab.hosts["core"]
    profile = host.profile or LinkProfile()
    rtt = echo(host, core, probes, PROBE_GAP_S, 1.0 + profile.rtt_ms / 250)
    warm = max(1.0, 10 * profile.rtt_ms / 1000)  # slow start: ~log2(BDP / 10 MSS) RTTs
    down = bulk(core, host, seconds + warm, warm)
    up = bulk(host, core, seconds + warm, warm)
    row: dict[str, Any] = {"profile": profile.as_dict(), "asked_rtt_ms": profile.rtt_ms, **rtt}
    for direction, got, rate in (("down", down, profile.down_mbit), ("up", up, profile.up_mbit)):
        row[direction] = {**got, "asked_mbit": rate, "ratio": got["mbit_steady"] / rate if rate else None}
    row["rtt_ratio"] = row["rtt_ms_mean"] / profile.rtt_ms if row["rtt_ms_mean"] else None
    return row


def run_check(
    out: Path, profiles: tuple[str, ...] = CHECKED, seconds: float = 4.0, probes: int = 2000
) -> dict[str, Any]:
    """Measure each profile through the emulator; write wan.json and wan.png under `out`."""
    out.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    spec = {"core": None, **{name: PRESETS[name] for name in profiles}}
    # SIGTERM unwinds as Ctrl+C does; leaving the session removes the lab and stops the emulator
    with interruptible(), lab_session(NetLab(spec, seed=1)) as lab:
        baseline = echo(lab.hosts["core"], lab.hosts["core"], 20, 0.01, 0.3)
        cc = subprocess.run(
            [*lab.hosts["core"].prefix, "cat", "/proc/sys/net/ipv4/tcp_congestion_control"],
            capture_output=True,
            text=True,
            timeout=30,
        ).stdout.strip()
        rows = {}
        for name in profiles:
            rows[name] = check_profile(lab, name, seconds, probes)
            print(_row_line(name, rows[name]), flush=True)
    report = {
        "what": "the lab's user-space WAN emulator: asked vs measured RTT, loss and TCP rate",
        "loopback_echo_ms": baseline["rtt_ms_mean"],  # the probe's own cost, no link crossed
        "tcp_congestion_control": cc,
        "goodput_share_of_rate": GOODPUT_SHARE,
        "seconds_per_transfer": seconds,
        "profiles": rows,
        "wall_s": time.perf_counter() - started,
    }
    (out / "wan.json").write_text(json.dumps(report, indent=2))
    plot_wan(report, out / "wan.png")
    return report


def _row_line(name: str, row: dict[str, Any]) -> str:
    down, up = row["down"], row["up"]
    return (
        f"{name:<11} RTT {row['rtt_ms_mean']:6.1f} ms (asked {row['asked_rtt_ms']:.0f})  "
        f"loss up/down {row['loss_up']:.3f}/{row['loss_down']:.3f} (asked {row['profile']['loss']})  "
        f"down {down['mbit_steady']:6.1f} Mbit/s (asked {down['asked_mbit']})  "
        f"up {up['mbit_steady']:6.1f} Mbit/s (asked {up['asked_mbit']})"
    )


def plot_wan(report: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(report["profiles"])
    rows = [report["profiles"][n] for n in names]
    x = range(len(names))
    fig, (ax_rtt, ax_rate) = plt.subplots(1, 2, figsize=(11, 4))
    ax_rtt.bar([i - 0.2 for i in x], [r["asked_rtt_ms"] for r in rows], 0.4, label="asked")
    ax_rtt.bar([i + 0.2 for i in x], [r["rtt_ms_mean"] or 0 for r in rows], 0.4, label="measured (mean)")
    ax_rtt.set_xticks(list(x), names)
    ax_rtt.set_ylabel("RTT to the core, ms")
    ax_rtt.legend()
    width = 0.2
    for k, (direction, label) in enumerate((("down", "down"), ("up", "up"))):
        asked = [r[direction]["asked_mbit"] or 0 for r in rows]
        got = [r[direction]["mbit_steady"] for r in rows]
        offset = (k * 2 - 1.5) * width
        ax_rate.bar([i + offset for i in x], asked, width, label=f"{label}: asked", alpha=0.5)
        ax_rate.bar([i + offset + width for i in x], got, width, label=f"{label}: measured")
    ax_rate.set_xticks(list(x), names)
    ax_rate.set_ylabel("one TCP flow, Mbit/s")
    ax_rate.legend(fontsize=7)
    fig.suptitle("netns lab WAN emulator: asked vs measured")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
