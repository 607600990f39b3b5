"""The demo's swarm: a coordinator, anchors and edge peers as real `hetnode` daemons, on loopback or each in
its own network namespace (`hetnode/lab/netlab/hosts.py`), started and stopped in order by the lab's launcher
(`hetnode/lab/swarm.py`: detached process groups, so a Ctrl+C at the terminal reaches only the demo, which
then stops the peers first and the coordinator last; the `p2pd` processes below the daemons are noted while
they run and killed if any outlives its daemon). What is the demo's own: its plan, the waits a stop signal
interrupts, and reading the running swarm (the coordinator's HTTP API, `hetnode status`).
"""

from __future__ import annotations

import json
import logging
import subprocess
import sys
import threading
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hetnode.lab.netlab.hosts import NetLab
from hetnode.lab.procs import HETNODE, LabProcess
from hetnode.lab.swarm import COORDINATOR, Launcher, Member
from hetnode.wire.round_history import merge_history

log = logging.getLogger(__name__)

HISTORY = "rounds.jsonl"  # the coordinator's sealed rounds (bootstrap/round_keeper.py)
STOP_TIMEOUT_S = 30.0  # a daemon that has not exited by then is killed
READY_TIMEOUT_S = 240.0  # two busy cores, five processes importing torch at once
HTTP_TIMEOUT_S = 3.0
_FETCH = (  # runs inside a namespace: the coordinator's HTTP server is reachable only from there
    "import sys,urllib.request;"
    "sys.stdout.write(urllib.request.urlopen(sys.argv[1],timeout=float(sys.argv[2])).read().decode())"
)


@dataclass(frozen=True)
class SwarmPlan:
    anchors: int
    chains: int
    stages: int  # members per chain
    edge_mbit: float
    shaped: bool = False
    anchor_mbit: float = 1000.0
    workers: int = 1  # workers on each chain's slowest stage: P + workers − 1 edges a chain

    def members(self) -> list[Member]:
        """Anchors and edges; an edge's declared Mbit/s is also the shaped rate of its link."""
        metrics = ("--metrics-port", "0")
        anchors = [
            Member(f"anchor-{i}", "anchor", self.anchor_mbit, metrics) for i in range(1, self.anchors + 1)
        ]
        edges = self.chains * (self.stages + self.workers - 1)
        return anchors + [Member(f"edge-{j}", "stage", self.edge_mbit, metrics) for j in range(1, edges + 1)]

    def rates(self) -> dict[str, float | None]:
        """Link rates for the lab: the coordinator and anchors unshaped, edges at `edge_mbit`."""
        return {COORDINATOR: None} | {
            m.name: (m.declared_mbit if m.role == "stage" else None) for m in self.members()
        }


class DemoSwarm:
    """The running swarm; `stop` (set by a signal) interrupts every wait."""

    def __init__(self, plan: SwarmPlan, work: Path, stop: threading.Event) -> None:
        self.plan = plan
        self.work = work
        self.stop = stop
        self.lab: NetLab | None = None
        self.launcher = Launcher(work)
        self.status_url: str | None = None
        self.leftovers: list[int] = []  # processes that outlived their daemon and were killed

    # -- starting ------------------------------------------------------------------------------------

    def start(self, config_path: Path) -> None:
        """Coordinator first (peers need its address), then every peer at once; returns when all are READY."""
        self.work.mkdir(parents=True, exist_ok=True)
        if self.plan.shaped:
            self.lab = NetLab(self.plan.rates())
            self.lab.__enter__()
            self.launcher.lab = self.lab
        boot = self.launcher.start_coordinator(config_path, self.work / "bootstrap", ["--http-port", "0"])
        ready = self.launcher.wait_ready(boot, READY_TIMEOUT_S, self.stop)
        self.status_url = ready.get("http")
        self.launcher.start_peers(boot.maddr, self.plan.members(), READY_TIMEOUT_S, self.stop)

    def _listen(self, host: str) -> str:
        return self.launcher.listen(host)

    def status_where(self) -> str:
        """Where the status page can be read: from here, or only inside the coordinator's namespace."""
        if self.lab is None:
            return f"{self.status_url}/"
        namespace = self.lab.hosts[COORDINATOR].namespace
        return f"{self.status_url}/ inside the coordinator's namespace: ip netns exec {namespace} curl ..."

    def _prefix(self, host: str) -> list[str]:
        return self.launcher.prefix(host)

    def log_path(self, name: str) -> Path:
        return self.work / f"{name}.log"

    @property
    def coordinator(self) -> LabProcess | None:
        return self.launcher.coordinator

    @property
    def peers(self) -> list[LabProcess]:
        return self.launcher.peers

    # -- while it runs -------------------------------------------------------------------------------

    @property
    def processes(self) -> list[LabProcess]:
        return self.launcher.processes

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
        self.launcher.track()

    # -- stopping ------------------------------------------------------------------------------------

    def stop_peers(self) -> None:
        self.launcher.stop_peers(STOP_TIMEOUT_S)

    def stop_coordinator(self) -> None:
        self.launcher.stop_coordinator(STOP_TIMEOUT_S)

    def close(self) -> None:
        """After the daemons stopped: kill anything of theirs still alive, then remove the lab."""
        self.leftovers.extend(self.launcher.kill_leftovers())
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
                    "bandwidth_mbit": member.declared_mbit if member else None,
                    "shaped": bool(self.lab or self.plan.shaped) and member is not None,
                    "peer_id": ids.get(process.name),
                    "log": str(process.log_path),
                    "data_dir": str(self.work / ("bootstrap" if member is None else process.name)),
                    "exit_code": process.proc.poll(),
                }
            )
        return rows


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
