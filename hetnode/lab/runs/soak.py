"""`hetnode bench soak`: one long run of real daemons in the netns lab while peers come and go on a schedule
(root only).

A coordinator, anchors and a pool of stage peers (a chain and a spare) train `tiny` together. At fixed shares
of the run, peers join, leave (SIGTERM), crash (SIGKILL), lose their link for 30 s, a live chain loses a
member, and the coordinator restarts once. Every minute each daemon's RSS and open fds (its p2pd included)
and every replica's digests are sampled. At the end: digest disagreements, half-applied rounds, ledger
mismatches against `rounds.jsonl`, chain re-forming and catch-up times, round times, resource slopes, and
that nothing the lab started is left. This module runs the lab (its daemons through the lab's launcher,
`hetnode/lab/swarm.py`); `soak_plan.py` holds the plan and its churn schedule, `soak_report.py` the verdicts
(`soak_checks.py` their arithmetic).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import time
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any

from hetnode.config import Config, dump_config
from hetnode.lab.guard import interruptible, shielded
from hetnode.lab.netlab.hosts import NetLab
from hetnode.lab.netlab.nat import NatLab
from hetnode.lab.procs import HETNODE, LabProcess
from hetnode.lab.proctree import process_tree
from hetnode.lab.runs import soak_checks
from hetnode.lab.runs.soak_plan import (
    LINK_DOWN_S,
    NAT_ANCHOR,
    NAT_ROUTER,
    ChurnEvent,
    SoakPlan,
    churn_schedule,
    lab_config,
    validate,
)
from hetnode.lab.runs.soak_report import Resources, live_times, summarise
from hetnode.lab.scale.lab_runs import ONE_THREAD, kill_leftovers
from hetnode.lab.swarm import Launcher, Member
from hetnode.wire.round_history import merge_history

COORDINATOR_PORT = 41000  # fixed, so that a restarted coordinator has the address the peers were given
STOP_GRACE_S = 5.0  # for the daemons to exit on SIGTERM before they are killed
HISTORY = "rounds.jsonl"


def tree_usage(pid: int) -> tuple[float, int]:
    """(RSS MB, open fds) of a process tree; what vanished while reading counts nothing."""
    rss_kb, fds = 0, 0
    for member in process_tree(pid):
        with contextlib.suppress(OSError, ValueError):
            for line in Path(f"/proc/{member}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    rss_kb += int(line.split()[1])
            fds += len(os.listdir(f"/proc/{member}/fd"))
    return rss_kb / 1024, fds


class Soak:
    """The running lab: its processes by name, what happened when, and the samples."""

    def __init__(
        self, lab: NetLab, config_path: Path, plan: SoakPlan, work: Path, say: Callable[[str], None]
    ):
        self.lab, self.config_path, self.plan, self.work, self.say = lab, config_path, plan, work, say
        # one torch thread per daemon, inside its host's namespace
        self.launcher = Launcher(work, lab, inside=lambda name: ONE_THREAD)
        self.processes: dict[str, LabProcess] = {}
        self.retired: list[LabProcess] = []  # stopped or killed: kept to close their logs
        self.events: list[dict[str, Any]] = []
        self.resources: dict[str, Resources] = {}  # per life: "anchor-2", then "anchor-2#2" after a restart
        self.life: dict[str, str] = {}
        self.digests: list[dict[str, Any]] = []
        self.coordinator_maddr = ""
        self.dead_stage: str | None = None
        self.peer_ids: dict[str, str] = {}
        self.reachability: dict[str, str] = {}  # the line each peer printed when it joined

    # processes

    def start_coordinator(self) -> None:
        self._new_life("coordinator")
        extra = ["--http-port", "off", "--metrics-port", "0"]
        process = self.launcher.start_coordinator(
            self.config_path, self.work / "coordinator", extra, port=COORDINATOR_PORT
        )
        self.processes["coordinator"] = process
        self.launcher.wait_ready(process, 180.0)
        self.coordinator_maddr = process.maddr

    def start_peer(self, name: str) -> LabProcess:
        anchor = name.startswith("anchor")
        link = self.plan.profile(name)
        rates = [r for r in (link.up_mbit, link.down_mbit) if r is not None]
        # it declares what its link carries (the slower way), as a volunteer's probe would find
        rate = min(rates) if rates else (self.plan.anchor_mbit if anchor else self.plan.stage_mbit)
        member = Member(name, "anchor" if anchor else "stage", rate, ("--metrics-port", "0"))
        self._new_life(name)
        self.processes[name] = self.launcher.start_peer(member, self.coordinator_maddr)
        return self.processes[name]

    def wait_ready(self, name: str) -> None:
        process = self.processes[name]
        self.peer_ids[name] = self.launcher.wait_ready(process, 240.0)["peer_id"]
        said = [line for line in process.lines if line.startswith("reachability:")]
        if said:
            self.reachability[name] = said[0]

    def _new_life(self, name: str) -> None:
        log = self.work / f"{name}.log"
        if log.exists():  # a restart: keep the earlier life's log next to the new one
            log.rename(self.work / f"{name}.{int(time.time())}.log")
        lives = sum(key.split("#")[0] == name for key in self.resources)
        self.life[name] = name if lives == 0 else f"{name}#{lives + 1}"
        self.resources[self.life[name]] = Resources()

    def stop(self, name: str, sig: signal.Signals) -> None:
        process = self.processes.pop(name)
        if sig == signal.SIGKILL:
            for pid in reversed(process_tree(process.proc.pid)):  # the daemon and its p2pd die together
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
        process.stop()  # SIGTERM (no-op once dead), then wait
        self.retired.append(process)

    def stop_everything(self) -> None:
        """The replicas at once, with one shared grace, then the coordinator; then whatever is left."""
        self.retired.extend(self.processes.values())
        self.processes.clear()
        self.launcher.stop(STOP_GRACE_S, STOP_GRACE_S)
        self.launcher.kill_leftovers()
        kill_leftovers(self.lab)

    # observations

    def history(self) -> list[dict[str, Any]]:
        path = self.work / "coordinator" / HISTORY
        out = []
        for line in path.read_text().splitlines() if path.exists() else []:
            try:
                out.append(json.loads(line))
            except ValueError:  # a line being written
                break
        return merge_history(out)  # each round's evaluated line, written beside the next seals

    def sealed(self) -> int:
        history = self.history()
        return history[-1]["round"] if history else -1

    def status(self) -> dict[str, Any] | None:
        host = self.lab.hosts["coordinator"]
        argv = [
            *host.prefix,
            *HETNODE,
            "status",
            "--peer",
            self.coordinator_maddr,
            "--json",
            "--timeout",
            "20",
        ]
        result = subprocess.run(argv, capture_output=True, text=True, timeout=60)
        try:
            return json.loads(result.stdout) if result.returncode == 0 else None
        except ValueError:
            return None

    def sample(self) -> None:
        now = time.time()
        for name, process in self.processes.items():
            if process.proc.poll() is None:
                rss, fds = tree_usage(process.proc.pid)
                self.resources[self.life[name]].rss_mb.append((now, rss))
                self.resources[self.life[name]].fds.append((now, float(fds)))
        document = self.status()
        if document is not None:
            checks = soak_checks.check_digests(document.get("peers", []), self.history())
            self.digests.append({"time": now, "checks": [asdict(c) for c in checks]})

    def note(self, kind: str, target: str, **detail: Any) -> None:
        entry = {"time": time.time(), "kind": kind, "target": target, "sealed": self.sealed(), **detail}
        self.events.append(entry)
        self.say(f"{kind} {target} (round {entry['sealed']})")

    # the events

    def apply(self, event: ChurnEvent) -> None:
        if event.kind == "join":
            self.start_peer(event.target)
            self.wait_ready(event.target)
            self.note("join", event.target)
        elif event.kind == "leave":
            self.stop(event.target, signal.SIGTERM)
            self.note("leave", event.target)
        elif event.kind == "crash":
            self.stop(event.target, signal.SIGKILL)
            self.note("crash", event.target)
        elif event.kind == "restart":
            name = self.dead_stage if event.target == "dead stage" else event.target
            if name is None:
                return
            self.start_peer(name)
            self.wait_ready(name)
            self.note("restart", name)
        elif event.kind == "link-down":
            self._link_down(event.target)
        elif event.kind == "chain-member-dies":
            name = self._live_stage()
            if name is None:
                self.note("chain-member-dies", "none", skipped="no stage had a live chain")
                return
            self.dead_stage = name
            self.stop(name, signal.SIGKILL)
            self.note("chain-member-dies", name)
        elif event.kind == "coordinator-restart":
            self.stop("coordinator", signal.SIGTERM)
            self.note("coordinator-stop", "coordinator")
            time.sleep(5.0)
            self.start_coordinator()
            self.note("coordinator-restart", "coordinator")

    def _link_down(self, name: str) -> None:
        host = self.lab.hosts[name]
        subprocess.run(["ip", "-n", host.namespace, "link", "set", host.device, "down"], check=True)
        self.note("link-down", name)
        time.sleep(LINK_DOWN_S)
        subprocess.run(["ip", "-n", host.namespace, "link", "set", host.device, "up"], check=True)
        self.note("link-up", name)

    def _live_stage(self) -> str | None:
        """The stage peer whose log last reported a live chain (and that still runs)."""
        latest: tuple[float, str] | None = None
        for name, process in self.processes.items():
            if name.startswith("stage") and process.proc.poll() is None:
                times = live_times(process.log_path)
                if times and (latest is None or times[-1] > latest[0]):
                    latest = (times[-1], name)
        return latest[1] if latest else None


def run_soak(config: Config, plan: SoakPlan, out: Path, progress: bool = True) -> dict[str, Any]:
    """The whole soak; everything it started is stopped on the way out (also on Ctrl+C, SIGTERM, errors)."""
    validate(plan)
    say = (lambda text: print(f"[bench soak] {text}", flush=True)) if progress else (lambda text: None)
    work = out / "work"
    if work.exists():
        subprocess.run(["rm", "-rf", str(work)], check=True)
    work.mkdir(parents=True)
    config = lab_config(config, plan)
    config_path = work / "swarm.toml"
    config_path.write_text(dump_config(config))
    anchors, stages = plan.names()
    late = f"anchor-{plan.anchors + 1}"
    rates = {name: plan.profile(name) for name in ["coordinator", *anchors, late, NAT_ROUTER, *stages]}
    # SIGTERM unwinds as Ctrl+C does; the cleanup below cannot be cut short by a second signal
    with interruptible():
        with NatLab(rates, behind_nat={NAT_ANCHOR: NAT_ROUTER}) as lab:
            soak = Soak(lab, config_path, plan, work, say)
            try:
                _drive(soak, plan, [*anchors, NAT_ANCHOR, *stages], say)
            finally:
                with shielded():
                    say("stopping every daemon")
                    soak.stop_everything()
            namespaces = [h.namespace for h in lab.hosts.values()] + [lab.hub]
        left = _left_behind(soak, namespaces)
    return summarise(soak, config, plan, left)


def _drive(soak: Soak, plan: SoakPlan, names: list[str], say: Callable[[str], None]) -> None:
    soak.start_coordinator()
    say(f"coordinator up at {soak.coordinator_maddr}; starting {len(names)} peers")
    for name in names:
        soak.start_peer(name)
    for name in names:
        soak.wait_ready(name)
    duration = plan.minutes * 60
    started = time.time()
    schedule = churn_schedule(plan)
    next_sample = started
    soak.note("start", "swarm")
    while time.time() < started + duration:
        now = time.time()
        if schedule and now >= started + schedule[0].at_share * duration:
            soak.apply(schedule.pop(0))
        if now >= next_sample:
            soak.sample()
            next_sample += plan.sample_every_s
            say(
                f"{(now - started) / 60:5.1f} / {plan.minutes:g} min: round {soak.sealed()}, "
                f"{len(soak.processes)} daemons"
            )
        time.sleep(1.0)
    _settle(soak)
    soak.sample()
    soak.note("end", "swarm")


def _settle(soak: Soak, timeout_s: float = 90.0) -> None:
    """Until every running replica holds the last sealed round (or the timeout): the final digests then
    compare like with like."""
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        document = soak.status()
        sealed = soak.sealed()
        if document is not None:
            rounds = [
                p.get("params_round")
                for p in document.get("peers", [])
                if p.get("role") in ("anchor", "stage")
            ]
            if rounds and all(r is not None and r >= sealed for r in rounds):
                return
        time.sleep(2.0)


def _left_behind(soak: Soak, namespaces: list[str]) -> dict[str, list]:
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    alive = []
    for process in soak.retired:
        with contextlib.suppress(ProcessLookupError):
            os.kill(process.proc.pid, 0)
            alive.append(process.name)
    return {"namespaces": [n for n in namespaces if n in listed], "processes": alive}
