"""The demo's processes: a coordinator, anchors and edge peers as real `hetnode` daemons, on loopback or
each in its own network namespace (`hetnode/lab/netlab/hosts.py`), started and stopped in order.

Every child runs in its own process group (`LabProcess(detach=True)`): a Ctrl+C at the terminal reaches
only the demo, which then stops the peers first and the coordinator last, instead of every daemon and
every `p2pd` getting the signal at once. Each child also gets SIGTERM if the demo dies. The `p2pd`
processes below the daemons are noted while they run and killed if any outlives its daemon.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hetnode.errors import HetnodeError
from hetnode.lab.netlab.hosts import NetLab
from hetnode.lab.procs import HETNODE, LabProcess
from hetnode.wire.round_history import merge_history

log = logging.getLogger(__name__)

LOOPBACK = "127.0.0.1"
HISTORY = "rounds.jsonl"  # the coordinator's sealed rounds (bootstrap/round_keeper.py)
COORDINATOR = "coordinator"
STOP_TIMEOUT_S = 30.0  # a daemon that has not exited by then is killed
READY_TIMEOUT_S = 240.0  # two busy cores, five processes importing torch at once
HTTP_TIMEOUT_S = 3.0
_FETCH = (  # runs inside a namespace: the coordinator's HTTP server is reachable only from there
    "import sys,urllib.request;"
    "sys.stdout.write(urllib.request.urlopen(sys.argv[1],timeout=float(sys.argv[2])).read().decode())"
)


class Interrupted(HetnodeError):
    """A stop signal arrived while the swarm was starting."""


@dataclass(frozen=True)
class Member:
    name: str
    role: str  # "anchor" or "stage" (passed as --role)
    bandwidth_mbit: float  # declared with --bandwidth; also the shaped rate of an edge


@dataclass(frozen=True)
class SwarmPlan:
    anchors: int
    chains: int
    stages: int  # members per chain
    edge_mbit: float
    shaped: bool = False
    anchor_mbit: float = 1000.0

    def members(self) -> list[Member]:
        anchors = [Member(f"anchor-{i}", "anchor", self.anchor_mbit) for i in range(1, self.anchors + 1)]
        edges = self.chains * self.stages
        return anchors + [Member(f"edge-{j}", "stage", self.edge_mbit) for j in range(1, edges + 1)]

    def rates(self) -> dict[str, float | None]:
        """Link rates for the lab: the coordinator and anchors unshaped, edges at `edge_mbit`."""
        return {COORDINATOR: None} | {
            m.name: (m.bandwidth_mbit if m.role == "stage" else None) for m in self.members()
        }


class DemoSwarm:
    """The running swarm; `stop` (set by a signal) interrupts every wait."""

    def __init__(self, plan: SwarmPlan, work: Path, stop: threading.Event) -> None:
        self.plan = plan
        self.work = work
        self.stop = stop
        self.lab: NetLab | None = None
        self.coordinator: LabProcess | None = None
        self.peers: list[LabProcess] = []
        self.status_url: str | None = None
        self.leftovers: list[int] = []  # processes that outlived their daemon and were killed
        self._tracked: dict[int, str] = {}  # pid -> its /proc start time, so a reused pid is not hit

    # -- starting ------------------------------------------------------------------------------------

    def start(self, config_path: Path) -> None:
        """Coordinator first (peers need its address), then every peer at once; returns when all are READY."""
        self.work.mkdir(parents=True, exist_ok=True)
        if self.plan.shaped:
            self.lab = NetLab(self.plan.rates())
            self.lab.__enter__()
        boot = ["bootstrap", "--config", str(config_path), "--listen", self._listen(COORDINATOR)]
        boot += ["--http-port", "0", "--data-dir", str(self.work / "bootstrap")]
        self.coordinator = self._spawn(COORDINATOR, boot)
        ready = self._wait_ready(self.coordinator)
        self.status_url = ready.get("http")
        for member in self.plan.members():
            args = ["join", "--peer", self.coordinator.maddr, "--name", member.name]
            args += ["--bandwidth", f"{member.bandwidth_mbit:g}", "--role", member.role]
            args += ["--listen", self._listen(member.name), "--data-dir", str(self.work / member.name)]
            self.peers.append(self._spawn(member.name, [*args, "--metrics-port", "0"]))
        for peer in self.peers:
            self._wait_ready(peer)
        self.track()

    def _listen(self, host: str) -> str:
        address = self.lab.hosts[host].address if self.lab else LOOPBACK
        return f"/ip4/{address}/tcp/0"

    def status_where(self) -> str:
        """Where the status page can be read: from here, or only inside the coordinator's namespace."""
        if self.lab is None:
            return f"{self.status_url}/"
        namespace = self.lab.hosts[COORDINATOR].namespace
        return f"{self.status_url}/ inside the coordinator's namespace: ip netns exec {namespace} curl ..."

    def _prefix(self, host: str) -> list[str]:
        return self.lab.hosts[host].prefix if self.lab else []

    def _spawn(self, name: str, args: list[str]) -> LabProcess:
        return LabProcess(name, [*HETNODE, *args], self.log_path(name), self._prefix(name), detach=True)

    def log_path(self, name: str) -> Path:
        return self.work / f"{name}.log"

    def _wait_ready(self, process: LabProcess, timeout: float = READY_TIMEOUT_S) -> dict[str, str]:
        deadline = time.monotonic() + timeout
        while process.ready is None:
            if self.stop.is_set():
                raise Interrupted(f"interrupted while waiting for {process.name}")
            if process.proc.poll() is not None:
                raise HetnodeError(
                    f"{process.name} exited with {process.proc.returncode} before READY:\n{process.tail()}"
                )
            if time.monotonic() > deadline:
                raise HetnodeError(f"{process.name} printed no READY line in {timeout:.0f} s")
            self.stop.wait(0.2)
        return process.ready

    # -- while it runs -------------------------------------------------------------------------------

    @property
    def processes(self) -> list[LabProcess]:
        return ([self.coordinator] if self.coordinator else []) + self.peers

    def peer_ids(self) -> dict[str, str]:
        """name -> peer id, for every process that printed its READY line."""
        return {p.name: p.ready["peer_id"] for p in self.processes if p.ready and "peer_id" in p.ready}

    def coordinator_exit(self) -> int | None:
        return None if self.coordinator is None else self.coordinator.proc.poll()

    def fetch(self, path: str) -> Any | None:
        """GET `path` from the coordinator's HTTP API as JSON; None when it does not answer."""
        if self.status_url is None:
            return None
        url = self.status_url + path
        try:
            if self.lab is None:
                with urllib.request.urlopen(url, timeout=HTTP_TIMEOUT_S) as response:
                    return json.loads(response.read())
            result = subprocess.run(
                [*self._prefix(COORDINATOR), sys.executable, "-I", "-c", _FETCH, url, str(HTTP_TIMEOUT_S)],
                capture_output=True,
                text=True,
                timeout=HTTP_TIMEOUT_S + 10,
                process_group=0,
            )
            return json.loads(result.stdout) if result.returncode == 0 else None
        except (OSError, ValueError, subprocess.TimeoutExpired):
            return None

    def history(self) -> list[dict[str, Any]]:
        """The coordinator's sealed rounds, from its `rounds.jsonl` (evaluated lines merged in)."""
        return merge_history(read_jsonl(self.work / "bootstrap" / HISTORY))

    def peer_status(self, timeout_s: float = 20.0) -> dict[str, Any] | None:
        """`hetnode status --json` through the coordinator: every peer's params_round and layer digests."""
        if self.coordinator is None or self.coordinator.ready is None:
            return None
        argv = [*self._prefix(COORDINATOR), *HETNODE, "status", "--peer", self.coordinator.maddr, "--json"]
        argv += ["--timeout", f"{timeout_s:g}", "--listen", self._listen(COORDINATOR)]
        with subprocess.Popen(
            argv, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, process_group=0
        ) as proc:
            deadline = time.monotonic() + timeout_s + 30
            while proc.poll() is None:
                if self.stop.is_set() or time.monotonic() > deadline:
                    proc.terminate()
                    try:
                        proc.wait(STOP_TIMEOUT_S)
                    except subprocess.TimeoutExpired:
                        proc.kill()
                    return None
                self.stop.wait(0.2)
            out = proc.stdout.read() if proc.stdout else ""
        try:
            return json.loads(out) if proc.returncode == 0 else None
        except ValueError:
            return None

    def track(self) -> None:
        """Note every process below our daemons (their p2pd), to make sure none outlives them."""
        for process in self.processes:
            for pid in descendants(process.proc.pid):
                started = start_time(pid)
                if started is not None:
                    self._tracked.setdefault(pid, started)

    # -- stopping ------------------------------------------------------------------------------------

    def stop_peers(self) -> None:
        _stop_together(self.peers)

    def stop_coordinator(self) -> None:
        _stop_together(self.processes[:1] if self.coordinator else [])

    def close(self) -> None:
        """After the daemons stopped: kill anything of theirs still alive, then remove the lab."""
        self.track()
        for pid, started in self._tracked.items():
            if start_time(pid) == started and alive(pid):
                log.warning("pid %d (%s) outlived its daemon: killing it", pid, process_name(pid))
                try:
                    os.kill(pid, signal.SIGKILL)
                except OSError:
                    continue
                self.leftovers.append(pid)
        if self.lab is not None:
            self.lab.close()
            self.lab = None

    def describe(self) -> list[dict[str, Any]]:
        """What ran, for the report: name, role, declared link, peer id, log, exit code."""
        members = {m.name: m for m in self.plan.members()}
        ids = self.peer_ids()
        rows = []
        for process in self.processes:
            member = members.get(process.name)
            rows.append(
                {
                    "name": process.name,
                    "role": member.role if member else COORDINATOR,
                    "bandwidth_mbit": member.bandwidth_mbit if member else None,
                    "shaped": bool(self.lab or self.plan.shaped) and member is not None,
                    "peer_id": ids.get(process.name),
                    "log": str(process.log_path),
                    "data_dir": str(self.work / ("bootstrap" if member is None else process.name)),
                    "exit_code": process.proc.poll(),
                }
            )
        return rows


def _stop_together(processes: list[LabProcess], timeout: float = STOP_TIMEOUT_S) -> None:
    """SIGTERM to all at once (they shut down in parallel), then wait; kill only one that hangs."""
    for process in processes:
        if process.proc.poll() is None:
            process.proc.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + timeout
    for process in processes:
        try:
            process.proc.wait(max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            log.warning("%s did not stop within %.0f s: killing it", process.name, timeout)
            process.proc.kill()
            process.proc.wait(10)
        process.stop()  # it has exited: this only closes its log


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    """One JSON object per line; a torn last line (a writer was stopped mid-line) is skipped."""
    try:
        text = path.read_text()
    except OSError:
        return []
    rows = []
    for line in text.splitlines():
        try:
            row = json.loads(line)
        except ValueError:
            continue
        if isinstance(row, dict):
            rows.append(row)
    return rows


# -- processes, from /proc --------------------------------------------------------------------------------


def _stat(pid: int) -> list[str] | None:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None


def descendants(pid: int) -> list[int]:
    """Every process below `pid` (children, their children, ...)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and (fields := _stat(int(entry.name))) is not None:
            children.setdefault(int(fields[1]), []).append(int(entry.name))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def start_time(pid: int) -> str | None:
    """The process's start time in clock ticks since boot (with the pid, it names one process)."""
    fields = _stat(pid)
    return fields[19] if fields else None


def process_name(pid: int) -> str | None:
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return None


def alive(pid: int) -> bool:
    """Running (a zombie has exited; it only waits for its parent to reap it)."""
    fields = _stat(pid)
    return fields is not None and fields[0] != "Z"
