"""A coordinator and its replicas as real daemons in the netns lab: the one swarm launcher that
`bench network` and `bench utilization` share (`hetnode/lab/procs.py` runs each process,
`hetnode/lab/guard.py` says why a lab stopped and keeps signals from cutting its cleanup short).

`with running_swarm(...) as swarm:` builds the lab, starts the coordinator, then every member, and waits
for their READY lines; the body measures whatever it wants; leaving stops the replicas at once (one shared
grace), then the coordinator, then removes the lab, also on Ctrl+C, SIGTERM or an error.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from hetnode.lab.guard import lab_session, shielded
from hetnode.lab.netlab.hosts import LinkSpec, NetLab
from hetnode.lab.procs import HETNODE, LabProcess, stop_all

STOP_GRACE_S = 5.0  # for the daemons to exit on SIGTERM before they are killed
HISTORY = "rounds.jsonl"  # the coordinator's sealed rounds (bootstrap/round_keeper.py)
ROUND_LOG = "rounds-local.jsonl"  # what every daemon writes per round (hetnode/service/round_log.py)


@dataclass(frozen=True)
class Member:
    """A replica of the swarm: its lab host's name, the role it asks for and the Mbit/s it declares."""

    name: str
    role: str  # "anchor" or "stage"
    declared_mbit: float


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


def _no_prefix(name: str) -> list[str]:
    return []


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
    host's namespace: outside it, since `ip netns exec` mounts a /sys of its own, without the cgroup
    hierarchy. Yields once every daemon printed READY."""
    work.mkdir(parents=True, exist_ok=True)
    processes: list[LabProcess] = []
    with lab_session(NetLab(links, seed=lab_seed)) as lab:
        try:
            coordinator = lab.hosts["coordinator"]
            boot = LabProcess(
                "coordinator",
                [*HETNODE, "bootstrap", "--config", str(config_path)]
                + ["--listen", f"/ip4/{coordinator.address}/tcp/0", "--data-dir", str(work / "coordinator")],
                work / "coordinator.log",
                prefix("coordinator") + coordinator.prefix,
            )
            processes.append(boot)
            boot.wait_ready(ready_timeout_s)
            say(f"lab {lab.tag}: coordinator up; starting {', '.join(m.name for m in members)}")
            for member in members:
                host = lab.hosts[member.name]
                argv = [*HETNODE, "join", "--peer", boot.maddr, "--name", member.name, "--role", member.role]
                argv += ["--bandwidth", f"{member.declared_mbit:g}", "--listen", f"/ip4/{host.address}/tcp/0"]
                processes.append(
                    LabProcess(
                        member.name,
                        argv + ["--data-dir", str(work / member.name)],
                        work / f"{member.name}.log",
                        prefix(member.name) + host.prefix,
                        detach=True,
                    )
                )
            swarm = RunningSwarm(lab, work, processes)
            swarm.ids = {p.name: p.wait_ready(ready_timeout_s)["peer_id"] for p in processes[1:]}
            yield swarm
        finally:
            with shielded():  # a second signal must not cut this short; leaving the lab removes it after
                stop_all(processes[1:], STOP_GRACE_S)  # replicas at once, then the coordinator
                stop_all(processes[:1], STOP_GRACE_S / 2)
