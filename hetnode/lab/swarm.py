"""A coordinator and its replicas as real daemons: the one swarm launcher of the lab (`hetnode/lab/procs.py`
runs each process, `hetnode/lab/guard.py` says why a lab stopped and keeps signals from cutting its cleanup
short, `hetnode/lab/proctree.py` finds what runs below a daemon).

`Launcher` starts the coordinator, waits for its READY line, then starts the peers (on loopback, or each in
its host of a network lab; under a prefix of the caller's: a CPU quota, `taskset`, an environment) and waits
for theirs; `stop` stops the peers at once (one shared grace), then the coordinator; `kill_leftovers` kills
whatever outlived its daemon (a `p2pd`). The demo, the lab runs, the GPU check and the swarm tests use it.

`with running_swarm(...) as swarm:` is the netns lab's form (`bench network`, `bench utilization`): builds
the lab, starts the swarm, yields once every daemon printed READY, and on the way out stops the daemons in
order and removes the lab, also on Ctrl+C, SIGTERM or an error.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from hetnode.lab.guard import lab_session, shielded
from hetnode.lab.netlab.hosts import LinkSpec, NetLab
from hetnode.lab.procs import HETNODE, LabProcess, stop_all
from hetnode.lab.proctree import alive, descendants, process_name, start_time

log = logging.getLogger(__name__)

STOP_GRACE_S = 5.0  # for the daemons to exit on SIGTERM before they are killed
HISTORY = "rounds.jsonl"  # the coordinator's sealed rounds (bootstrap/round_keeper.py)
ROUND_LOG = "rounds-local.jsonl"  # what every daemon writes per round (hetnode/service/round_log.py)
COORDINATOR = "coordinator"
LOOPBACK = "127.0.0.1"


@dataclass(frozen=True)
class Member:
    """A replica of the swarm: its name (and lab host's), the role it asks for, the Mbit/s it declares."""

    name: str
    role: str | None  # "anchor" or "stage" (--role); None: the daemon's default
    declared_mbit: float | str  # --bandwidth: Mbit/s, or "auto" (the daemon probes its link)
    extra: tuple[str, ...] = ()  # more `hetnode join` arguments (--metrics-port 0, --device cuda, ...)


def _no_prefix(name: str) -> list[str]:
    return []


class Launcher:
    """One swarm's daemons. `lab`: a network lab whose hosts are named as the daemons (None: loopback);
    each daemon runs under `outside(name)`, then its host's namespace, then `inside(name)`: a cgroup's
    prefix must stay outside, since `ip netns exec` mounts a /sys of its own, without the cgroup hierarchy.
    `detach`: each daemon in its own process group (`LabProcess`), so a terminal's Ctrl+C reaches only
    this process, which stops them in order. `process`: the class that runs each one."""

    def __init__(
        self,
        work: Path,
        lab: NetLab | None = None,
        *,
        outside: Callable[[str], list[str]] = _no_prefix,
        inside: Callable[[str], list[str]] = _no_prefix,
        detach: bool = True,
        process: type[LabProcess] = LabProcess,
    ) -> None:
        self.work = work
        self.lab = lab
        self.outside, self.inside = outside, inside
        self.detach = detach
        self.process = process
        self.coordinators: list[LabProcess] = []  # every life of the coordinator, the running one last
        self.peers: list[LabProcess] = []
        self.tracked: dict[int, str | None] = {}  # pid below a daemon -> its start time

    @property
    def coordinator(self) -> LabProcess | None:
        return self.coordinators[-1] if self.coordinators else None

    @property
    def processes(self) -> list[LabProcess]:
        """The coordinators first, then the peers, in order of start."""
        return self.coordinators + self.peers

    def prefix(self, name: str) -> list[str]:
        host = self.lab.hosts[name].prefix if self.lab is not None else []
        return self.outside(name) + host + self.inside(name)

    def listen(self, name: str, port: int = 0) -> str:
        address = self.lab.hosts[name].address if self.lab is not None else LOOPBACK
        return f"/ip4/{address}/tcp/{port}"

    def spawn(
        self, name: str, argv: list[str], prefix: list[str] | None = None, *, coordinator: bool = False
    ) -> LabProcess:
        """`argv` under this daemon's prefix (or `prefix`), its stderr to `work/NAME.log`; stopped with the
        coordinators (last) or the peers (first)."""
        prefix = self.prefix(name) if prefix is None else prefix
        process = self.process(name, argv, self.work / f"{name}.log", prefix, detach=self.detach)
        (self.coordinators if coordinator else self.peers).append(process)
        return process

    def start_coordinator(
        self,
        config_path: Path,
        data_dir: Path,
        extra: Sequence[str] = (),
        *,
        name: str = COORDINATOR,
        port: int = 0,
        listen: str | None = None,
        command: list[str] | None = None,
        prefix: list[str] | None = None,
    ) -> LabProcess:
        """`hetnode bootstrap` (or `command` with its arguments), not waited for."""
        argv = ["bootstrap", "--config", str(config_path), "--listen", listen or self.listen(name, port)]
        argv += ["--data-dir", str(data_dir), *extra]
        return self.spawn(name, [*(command or HETNODE), *argv], prefix, coordinator=True)

    def start_peer(
        self,
        member: Member,
        coordinator: str,
        *,
        listen: str | None = None,
        command: list[str] | None = None,
        prefix: list[str] | None = None,
    ) -> LabProcess:
        """`hetnode join` of `member` through the coordinator's multiaddr, its data in `work/NAME`; not
        waited for."""
        bandwidth = member.declared_mbit
        argv = ["join", "--peer", coordinator, "--name", member.name]
        argv += ["--bandwidth", bandwidth if isinstance(bandwidth, str) else f"{bandwidth:g}"]
        argv += ["--role", member.role] if member.role is not None else []
        argv += ["--listen", listen or self.listen(member.name), "--data-dir", str(self.work / member.name)]
        return self.spawn(member.name, [*(command or HETNODE), *argv, *member.extra], prefix)

    def wait_ready(
        self, process: LabProcess, timeout: float, stop: threading.Event | None = None
    ) -> dict[str, str]:
        """Its READY line's fields; then what runs below it is noted (`kill_leftovers`)."""
        ready = process.wait_ready(timeout, stop)
        self.track()
        return ready

    def start_peers(
        self,
        coordinator: str,
        members: Sequence[Member],
        ready_timeout_s: float,
        stop: threading.Event | None = None,
    ) -> dict[str, str]:
        """Every member at once, then their READY lines: name -> peer id."""
        started = [self.start_peer(member, coordinator) for member in members]
        return {p.name: self.wait_ready(p, ready_timeout_s, stop)["peer_id"] for p in started}

    def track(self) -> None:
        """Note every process below the daemons (their p2pd), to make sure none outlives them."""
        for process in self.processes:
            if process.proc.poll() is not None:  # reaped: its pid may name another process by now
                continue
            for pid in descendants(process.proc.pid):
                self.tracked.setdefault(pid, start_time(pid))

    def stop_peers(self, grace_s: float = STOP_GRACE_S) -> None:
        self.track()
        stop_all(self.peers, grace_s)

    def stop_coordinator(self, grace_s: float = STOP_GRACE_S) -> None:
        self.track()
        stop_all(self.coordinators, grace_s)

    def stop(self, grace_s: float = STOP_GRACE_S, coordinator_grace_s: float | None = None) -> None:
        """The peers at once (one shared grace), then the coordinator: the peers announce their exit to
        a coordinator still there."""
        self.stop_peers(grace_s)
        self.stop_coordinator(grace_s if coordinator_grace_s is None else coordinator_grace_s)

    def kill_leftovers(self, only: str | None = None) -> list[int]:
        """After the daemons stopped: SIGKILL whatever noted below them still runs (named `only`, when
        given); returns their pids."""
        self.track()
        killed = []
        for pid, started in self.tracked.items():
            if start_time(pid) != started or not alive(pid):
                continue
            name = process_name(pid)
            if only is not None and name != only:
                continue
            log.warning("pid %d (%s) outlived its daemon: killing it", pid, name)
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                continue
            killed.append(pid)
        return killed


@dataclass
class RunningSwarm:
    lab: NetLab
    work: Path
    processes: list[LabProcess]  # the coordinator first
    ids: dict[str, str] = field(default_factory=dict)  # member name -> peer id

    @property
    def coordinator(self) -> LabProcess:
        return self.processes[0]

    def history(self) -> list[dict]:
        return merged_history(read_jsonl(self.work / "coordinator" / HISTORY))

    def round_log(self, name: str) -> list[dict]:
        return read_jsonl(self.work / name / ROUND_LOG)

    def logs(self) -> dict[str, Path]:
        """Each member's daemon log (for `lab_guard.stalled_reason`)."""
        return {p.name: p.log_path for p in self.processes[1:]}


def read_jsonl(path: Path) -> list[dict]:
    """The lines of a JSON-lines file written by a running daemon; a half-written last line is skipped."""
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        if line.strip():
            try:
                out.append(json.loads(line))
            except ValueError:
                break
    return out


def merged_history(rows: list[dict]) -> list[dict]:
    """One entry per sealed round: a coordinator that evaluates beside the seal appends the round's
    evaluation later as a line of its own (`{"round": t, "evaluated": true, "eval_loss": ...}`, no
    `contributors`), folded here into the newest seal line of its round; older histories pass unchanged."""
    entries: list[dict] = []
    newest: dict[int, dict] = {}
    for row in rows:
        if row.get("evaluated") is True and "contributors" not in row:
            if row.get("round") in newest:
                newest[row["round"]].update({k: v for k, v in row.items() if k != "round"})
            continue
        entries.append(dict(row))
        newest[row.get("round")] = entries[-1]
    return entries


@contextmanager
def running_swarm(
    config_path: Path,
    work: Path,
    links: Mapping[str, LinkSpec],
    members: Sequence[Member],
    say: Callable[[str], None],
    prefix: Callable[[str], list[str]] = _no_prefix,
    ready_timeout_s: float = 120.0,
    lab_seed: int = 0,
) -> Iterator[RunningSwarm]:
    """The lab of `links` (host name -> link; "coordinator" and every member's name), a coordinator and
    `members`, each process run under `prefix(name)` (taskset, a cgroup, an environment) and then in its
    host's namespace. Yields once every daemon printed READY."""
    work.mkdir(parents=True, exist_ok=True)
    with lab_session(NetLab(links, seed=lab_seed)) as lab:
        launcher = Launcher(work, lab, outside=prefix)
        try:
            boot = launcher.start_coordinator(config_path, work / "coordinator")
            launcher.wait_ready(boot, ready_timeout_s)
            say(f"lab {lab.tag}: coordinator up; starting {', '.join(m.name for m in members)}")
            ids = launcher.start_peers(boot.maddr, members, ready_timeout_s)
            yield RunningSwarm(lab, work, launcher.processes, ids)
        finally:
            with shielded():  # a second signal must not cut this short; leaving the lab removes it after
                launcher.stop(STOP_GRACE_S, STOP_GRACE_S / 2)
                launcher.kill_leftovers()
