"""The lab side of `hetnode bench scale --calibrate`: real daemons on shaped links (root only).

A coordinator, `anchors` anchors and `chains` chains of `stages` stages, each in a network namespace of
`hetnode/lab/netlab/hosts.py` whose link is shaped with tc both ways, run sealed rounds until `rounds` rounds
after the warm-up had every replica in them. What one round cost comes from three places:
- the daemons' round logs (`rounds-local.jsonl`: sealed download, fetch_s, apply_s, seal_wait_s);
- their /metrics (hetnode_bytes_{sent,received}_total{channel="sync"}: payload bytes served and fetched);
- every host's interface counters (DHT, TCP/IP and p2pd framing included).
Counters are read each time the coordinator appends a sealed round to its history; a round's cost is the
counters' change over the measured rounds, divided by their number (a round's fetches straddle the moment
its history line is written, so single-round differences mix neighbouring rounds).
"""

from __future__ import annotations

import json
import re
import shutil
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hetnode.config import Config, dump_config
from hetnode.errors import HetnodeError
from hetnode.lab.guard import (
    STALL_ROUNDS,
    LabStalled,
    check_running,
    interruptible,
    lab_session,
    shielded,
    stalled_reason,
)
from hetnode.lab.netlab.hosts import NetLab, kill_inside
from hetnode.lab.netlab.link_trace import LinkTrace, LinkTracer
from hetnode.lab.netlab.sync_windows import (
    plot_round,
    round_windows,
    summary,
    window_cores,
    window_cpu,
    window_load,
)
from hetnode.lab.procs import LabProcess
from hetnode.lab.swarm import Launcher, Member
from hetnode.wire.round_history import merge_history

ROUND_LOG = "rounds-local.jsonl"  # what every daemon writes per round (hetnode/service/round_log.py)

# one torch thread per daemon: ten processes with a thread per core each would spin against each other
ONE_THREAD = ["env", "OMP_NUM_THREADS=1"]
HISTORY = "rounds.jsonl"  # the coordinator's sealed rounds (bootstrap/round_keeper.py)
# a stage's log line when its chain goes live (hetnode/daemon/peer.py): which layers the planner gave it
LIVE = re.compile(r"live: stage (\d+), layers (\d+)\.\.(\d+)")
STOP_GRACE_S = 5.0  # for the daemons to exit on SIGTERM before they are killed
SYNC = re.compile(r'^hetnode_bytes_(sent|received)_total\{channel="sync"\} (\S+)$', re.MULTILINE)


@dataclass(frozen=True)
class CalibrationPlan:
    anchors: int = 7
    chains: int = 1
    stages: int = 2  # per chain
    coordinator_mbit: float = 100.0
    anchor_mbit: float = 100.0
    stage_mbit: float = 20.0
    inner_steps: int = 15  # H: short rounds; the sync is what is measured
    # cores (taskset): on two shared cores a chain's round, a micro-batch at a time through its stages,
    # ends long after the anchors' and the seal leaves it out; the chain and the coordinator get a core
    # of their own, the anchors share the other
    chain_cores: str = "0"
    anchor_cores: str = "1"
    batch_size: int = 2  # sequences per inner step: ten trainers share two cores
    seq_len: int = 64
    warmup_rounds: int = 2
    rounds: int = 4  # measured rounds with every replica in them
    timeout_s: float = 480.0

    @property
    def replicas(self) -> int:
        return self.anchors + self.chains

    def names(self) -> tuple[list[str], list[str]]:
        anchors = [f"anchor-{i + 1}" for i in range(self.anchors)]
        stages = [f"stage-{c + 1}.{s + 1}" for c in range(self.chains) for s in range(self.stages)]
        return anchors, stages


def _say(progress: bool, text: str) -> None:
    if progress:
        print(f"[bench scale --calibrate] {text}", flush=True)


def run_lab(config: Config, plan: CalibrationPlan, work: Path, progress: bool = True) -> dict[str, Any]:
    """Start the swarm, measure `plan.rounds` full rounds after the warm-up, stop everything (also on
    Ctrl+C and errors: the processes in reverse order, then the namespaces with their veths)."""
    shutil.rmtree(work, ignore_errors=True)  # no identities, checkpoints or logs from an earlier run
    work.mkdir(parents=True)
    config_path = work / "swarm.toml"
    config_path.write_text(dump_config(config))
    anchors, stages = plan.names()
    rates = {"coordinator": plan.coordinator_mbit}
    rates |= {a: plan.anchor_mbit for a in anchors} | {s: plan.stage_mbit for s in stages}
    # a SIGTERM (a `timeout`, a CI runner) unwinds like Ctrl+C, so that every cleanup below runs; leaving
    # deletes the namespaces and veths
    with interruptible(), lab_session(NetLab(rates)) as lab, LinkTracer(lab.hub, lab.hub_devices) as trace:
        samples, ids, rtt_s, pids = _run_swarm(lab, config_path, plan, work, progress)
    logs = {name: read_rounds(work / name) for name in (*anchors, *stages)}
    summary = summarise(samples, logs, ids, plan, rtt_s)
    layers = stage_layers(work, stages)
    return summary | {
        "stage_layers": layers,
        "links": link_load(trace, logs, summary["rounds"], rates, layers, work)
        | {"cpu": window_cpu(trace, round_windows(logs, summary["rounds"]), pids)},
    }


def link_load(
    trace: LinkTrace,
    logs: dict[str, list[dict]],
    rounds: list[int],
    rates: dict[str, float],
    layers: dict[str, list[int]],
    work: Path,
) -> dict[str, Any]:
    """What the links carried in each measured round's sealing and fetching windows (`sync_windows`),
    per host and per class; the trace itself and a plot of the median round's links in `work`."""
    windows = round_windows(logs, rounds)
    if not trace.times or not windows:
        return {}
    load = window_load(trace, windows, rates)
    stages = sorted(layers, key=lambda n: layers[n][0])
    classes = {"coordinator": ["coordinator"], "anchor": [n for n in rates if n.startswith("anchor")]}
    classes |= {f"stage {layers[n][0]}": [n] for n in stages}
    (work / "link-trace.json").write_text(json.dumps(trace.to_json(list(rates))))
    ordered = sorted(windows, key=lambda n: windows[n]["fetched"] - windows[n]["sealed"])
    middle = ordered[len(ordered) // 2]
    plot_round(trace, windows[middle], rates, work / "link-trace.png", f"round {middle}")
    return {
        "windows": {str(n): w for n, w in windows.items()},
        "by_class": summary(load, classes),
        "cores": window_cores(trace, windows),
        "hosts": load,
    }


def stage_layers(work: Path, stages: list[str]) -> dict[str, list[int]]:
    """{stage daemon: [stage index, first layer, last layer]} from the last chain each went live in."""
    out = {}
    for name in stages:
        found = LIVE.findall((work / f"{name}.log").read_text())
        if found:
            out[name] = [int(x) for x in found[-1]]
    return out


def _run_swarm(
    lab: NetLab, config_path: Path, plan: CalibrationPlan, work: Path, progress: bool
) -> tuple[list[dict], dict[str, str], float, dict[str, int]]:
    """The daemons in the lab until the measured rounds are in; every daemon (and its p2pd) stopped on the
    way out: the replicas, then the coordinator."""
    anchors, stages = plan.names()

    def pinned(name: str) -> list[str]:  # inside the host's namespace
        return ONE_THREAD + ["taskset", "-c", plan.anchor_cores if name in anchors else plan.chain_cores]

    launcher = Launcher(work, lab, inside=pinned)
    try:
        extra = ["--http-port", "off", "--metrics-port", "0"]
        boot = launcher.start_coordinator(config_path, work / "coordinator", extra)
        launcher.wait_ready(boot, 120.0)
        _say(
            progress, f"lab {lab.tag}: coordinator up; starting {len(anchors)} anchors, {len(stages)} stages"
        )
        members = [Member(a, "anchor", plan.anchor_mbit, ("--metrics-port", "0")) for a in anchors]
        members += [Member(s, "stage", plan.stage_mbit, ("--metrics-port", "0")) for s in stages]
        ids = launcher.start_peers(boot.maddr, members, 240.0)
        processes = launcher.processes
        urls = {p.name: _metrics_url(p.ready or {}) for p in processes}
        rtt_s = measure_rtt(lab, anchors[0], boot.maddr)
        _say(
            progress,
            f"all up; RTT {rtt_s * 1000:.2f} ms; waiting for {plan.warmup_rounds} + {plan.rounds} rounds",
        )
        samples = _follow(lab, urls, work / "coordinator", set(ids.values()), plan, progress, processes)
    finally:
        # a second Ctrl+C or SIGTERM (`timeout` sends one to the child and one to its group) must not cut
        # the cleanup short: daemons left running hang once their namespace's links are gone
        with shielded():
            # replicas first, all at once (each takes seconds to announce its exit), then the coordinator
            launcher.stop(STOP_GRACE_S, STOP_GRACE_S / 2)
            launcher.kill_leftovers()
            kill_leftovers(lab)
    return samples, ids, rtt_s, {p.name: p.proc.pid for p in launcher.processes}


def kill_leftovers(lab: NetLab) -> None:
    """SIGKILL whatever still runs in the lab's namespaces (a daemon that ignored SIGTERM, or the p2pd of
    one that was killed): they are ours, as the namespaces are."""
    for host in lab.hosts.values():
        kill_inside(host.namespace)


def _metrics_url(ready: dict[str, str]) -> str:
    url = ready.get("metrics")
    if not url:
        raise HetnodeError(f"no metrics URL in the READY line {ready}")
    return url if url.endswith("/metrics") else f"{url}/metrics"


def measure_rtt(lab: NetLab, host: str, maddr: str, tries: int = 5) -> float:
    """The median TCP connect time from `host` to the coordinator's listening port: one round trip."""
    address, port = maddr.split("/")[2], maddr.split("/")[4]
    probe = (
        "import socket,statistics,time\nts=[]\n"
        f"for _ in range({tries}):\n"
        "    t=time.perf_counter()\n"
        f"    socket.create_connection(('{address}',{port}),5).close()\n"
        "    ts.append(time.perf_counter()-t)\n"
        "print(statistics.median(ts))"
    )
    out = subprocess.run(
        [*lab.hosts[host].prefix, sys.executable, "-c", probe], capture_output=True, text=True, timeout=30
    )
    try:
        return float(out.stdout.strip())
    except ValueError:
        raise HetnodeError(f"could not time a connection from {host}: {out.stderr.strip()}") from None


def _scrape(lab: NetLab, name: str, url: str) -> dict[str, float]:
    """The sync byte counters of one daemon, read inside its namespace (loopback: no lab link carries it)."""
    out = subprocess.run(
        [*lab.hosts[name].prefix, "curl", "-s", "--max-time", "5", url], capture_output=True, text=True
    ).stdout
    return {direction: float(value) for direction, value in SYNC.findall(out)}


def _sample(lab: NetLab, urls: dict[str, str]) -> dict[str, Any]:
    with ThreadPoolExecutor(max_workers=len(urls)) as pool:
        sync = dict(zip(urls, pool.map(lambda n: _scrape(lab, n, urls[n]), urls), strict=True))
        wire = dict(zip(lab.hosts, pool.map(lab.interface_bytes, lab.hosts), strict=True))
    return {
        "time": time.time(),
        "sync": sync,
        "wire": {n: {"rx": rx, "tx": tx} for n, (rx, tx) in wire.items()},
    }


def _history(coordinator_dir: Path) -> list[dict]:
    path = coordinator_dir / HISTORY
    if not path.exists():
        return []
    lines = path.read_text().splitlines()
    out = []
    for line in lines:
        try:
            out.append(json.loads(line))
        except ValueError:  # a line being written
            break
    return merge_history(out)  # each round's evaluated line, written beside the next seals


def _follow(
    lab: NetLab,
    urls: dict[str, str],
    coordinator_dir: Path,
    everyone: set[str],
    plan: CalibrationPlan,
    progress: bool,
    processes: list[LabProcess] | None = None,
) -> list[dict]:
    """A sample of every counter at each new history line, until `plan.rounds` full rounds followed the
    warm-up; each sample carries its history entry. Ends with the reason (roles, exits) when a daemon
    exits, when STALL_ROUNDS sealed rounds in a row were not full, or at `plan.timeout_s`."""
    processes = processes or []
    logs = {p.name: p.log_path for p in processes[1:]}
    deadline = time.monotonic() + plan.timeout_s
    samples: list[dict] = []
    while time.monotonic() < deadline:
        check_running(processes)
        history = _history(coordinator_dir)
        for entry in history[len(samples) :]:
            sample = _sample(lab, urls) | {"entry": entry, "full": everyone <= set(entry["contributors"])}
            samples.append(sample)
            _say(
                progress,
                f"round {entry['round']}: {len(entry['contributors'])} of {len(everyone)} contributions"
                + (" (warm-up)" if len(samples) <= plan.warmup_rounds else ""),
            )
        measured = samples[plan.warmup_rounds :]
        if sum(s["full"] for s in measured) >= plan.rounds:
            return samples
        since_full = next((i for i, s in enumerate(reversed(samples)) if s["full"]), len(samples))
        if since_full >= STALL_ROUNDS:
            raise LabStalled(
                f"{STALL_ROUNDS} sealed rounds in a row without every replica; the daemons' roles:\n"
                + stalled_reason(processes, logs)
            )
        time.sleep(0.25)
    raise LabStalled(
        f"{plan.rounds} full rounds after the warm-up did not come within {plan.timeout_s:.0f} s; "
        "the daemons' roles:\n" + stalled_reason(processes, logs)
    )


def _median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def summarise(
    samples: list[dict], logs: dict[str, list[dict]], ids: dict[str, str], plan: CalibrationPlan, rtt_s: float
) -> dict[str, Any]:
    """Per round: each counter's change over the measured window, per host; the round logs' medians."""
    first, last = samples[plan.warmup_rounds - 1], samples[-1]
    window = samples[plan.warmup_rounds :]
    n = len(window)
    rounds = [s["entry"]["round"] for s in window]
    hosts = {}
    for name in last["wire"]:
        sync = {
            d: (last["sync"].get(name, {}).get(d, 0.0) - first["sync"].get(name, {}).get(d, 0.0)) / n
            for d in ("sent", "received")
        }
        wire = {d: (last["wire"][name][d] - first["wire"][name][d]) / n for d in ("rx", "tx")}
        hosts[name] = {"sync_sent": sync["sent"], "sync_received": sync["received"], **wire}
    per_log = {}
    for name, records in logs.items():
        mine = [r for r in records if r["round"] in rounds and r["included"]]
        per_log[name] = {
            key: _median([r[key] for r in mine])
            for key in ("download_bytes", "upload_bytes", "fetch_s", "apply_s", "seal_wait_s")
        }
        per_log[name]["rounds"] = len(mine)
    return {
        "rounds": rounds,
        "full_rounds": sum(s["full"] for s in window),
        "round_wall_s": (last["time"] - first["time"]) / n,
        "rtt_s": rtt_s,
        "hosts": hosts,
        "logs": per_log,
        "critical_sync_s": _median(critical_sync_s(logs, rounds)),
        "critical_fetch_s": _median(critical_sync_s(logs, rounds, fetched_only=True)),
        "peer_ids": ids,
        "history": [s["entry"] | {"layer_digests": None} for s in samples],
    }


def critical_sync_s(
    logs: dict[str, list[dict]], rounds: list[int], fetched_only: bool = False
) -> list[float]:
    """Per round: from the last replica's announcement to the last replica having applied the round (each
    record's `time` is taken just before announcing); `fetched_only`: to the last replica holding every
    sealed payload (what the network does, before decoding and applying take the CPUs)."""
    out = []
    for n in rounds:
        records = [r for rs in logs.values() for r in rs if r["round"] == n and r["included"] and "time" in r]
        if records:
            announced = max(r["time"] for r in records)
            done = [r["fetch_s"] if fetched_only else r["apply_s"] for r in records]
            out.append(
                max(r["time"] + r["seal_wait_s"] + d for r, d in zip(records, done, strict=True)) - announced
            )
    return out


def read_rounds(data_dir: Path) -> list[dict]:
    """A daemon's round log (bench sits below service/, so it reads the file itself)."""
    path = data_dir / ROUND_LOG
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
