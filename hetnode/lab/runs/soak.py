"""`hetnode bench soak`: one long run of real daemons in the netns lab while peers come and go on a schedule
(root only).

A coordinator, anchors and a pool of stage peers (a chain and a spare) train `tiny` together. At fixed shares
of the run, peers join, leave (SIGTERM), crash (SIGKILL), lose their link for 30 s, a live chain loses a
member, and the coordinator restarts once. Every minute each daemon's RSS and open fds (its p2pd included)
and every replica's digests are sampled. At the end: digest disagreements, half-applied rounds, ledger
mismatches against `rounds.jsonl`, chain re-forming and catch-up times, round times, resource slopes, and
that nothing the lab started is left (`hetnode/lab/runs/soak_checks.py` holds the arithmetic).
"""

from __future__ import annotations

import contextlib
import datetime
import json
import os
import re
import signal
import sqlite3
import statistics
import subprocess
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from hetnode.config import Config, dump_config, replace
from hetnode.errors import HetnodeError
from hetnode.lab.guard import interruptible, shielded
from hetnode.lab.netlab.hosts import NetLab
from hetnode.lab.netlab.nat import NatLab
from hetnode.lab.netlab.wan import describe
from hetnode.lab.procs import HETNODE, LabProcess, stop_all
from hetnode.lab.runs import soak_checks
from hetnode.lab.runs.soak_plan import SoakPlan
from hetnode.lab.scale.lab_runs import ONE_THREAD, kill_leftovers, read_rounds
from hetnode.wire.round_history import merge_history

COORDINATOR_PORT = 41000  # fixed, so that a restarted coordinator has the address the peers were given
LINK_DOWN_S = 30.0
MIN_SLOPE_SPAN_S = 600.0  # a life's samples after its warm-up must span this much for a slope
STOP_GRACE_S = 5.0  # for the daemons to exit on SIGTERM before they are killed
HISTORY = "rounds.jsonl"
LEDGER = "ledger.sqlite"
LIVE_LINE = " live: stage "
ROLE_CHANGE = r" live: stage |boundary \d+: role |: class \w+, role "  # hetnode/daemon/peer.py's lines
LOG_TIME = "%H:%M:%S"
NAT_ANCHOR, NAT_ROUTER = "anchor-nat", "home"  # a volunteer behind a masquerading home router
LAB_NETWORK = {"heartbeat_s": 2.0, "record_ttl_s": 8.0, "stable_heartbeat_s": 8.0, "boundary_s": 4.0}


@dataclass(frozen=True)
class ChurnEvent:
    at_share: float  # of the run
    kind: str  # join, leave, crash, restart, link-down, chain-member-dies, coordinator-restart
    target: str


def churn_schedule(plan: SoakPlan) -> list[ChurnEvent]:
    """The events, in order. Every kind the issue names happens once; the peers that left come back, so that
    their catch-up is measured."""
    anchors, _ = plan.names()
    late = f"anchor-{plan.anchors + 1}"
    return [
        ChurnEvent(0.10, "join", late),
        ChurnEvent(0.18, "leave", anchors[1]),
        ChurnEvent(0.26, "restart", anchors[1]),
        ChurnEvent(0.34, "crash", anchors[2]),
        ChurnEvent(0.42, "restart", anchors[2]),
        ChurnEvent(0.50, "link-down", anchors[0]),
        ChurnEvent(0.60, "chain-member-dies", "live stage"),
        ChurnEvent(0.70, "coordinator-restart", "coordinator"),
        ChurnEvent(0.80, "restart", "dead stage"),
    ]


def validate(plan: SoakPlan) -> None:
    """Refuse a plan that cannot show what the soak measures."""
    if plan.anchors < 3:
        raise HetnodeError(
            "bench soak needs --anchors 3 or more: one leaves, one crashes, one loses its link"
        )
    if plan.stage_peers < plan.stages + 1:
        raise HetnodeError(
            f"bench soak needs {plan.stages + 1} stage peers: a chain and a spare to re-form it"
        )
    if plan.minutes * 60 * 0.08 < LINK_DOWN_S:
        raise HetnodeError(
            f"--minutes {plan.minutes:g} is too short: events are 8 % of the run apart and a "
            f"link stays down {LINK_DOWN_S:g} s (use --minutes 7 or more)"
        )
    anchors, stages = plan.names()
    hosts = {"coordinator", *anchors, f"anchor-{plan.anchors + 1}", NAT_ROUTER, *stages}
    unknown = sorted({host for host, _ in plan.wan} - hosts)
    if unknown:
        raise HetnodeError(f"--wan names no lab host: {unknown}; the hosts are {', '.join(sorted(hosts))}")


def lab_config(config: Config, plan: SoakPlan) -> Config:
    config = replace(config, "outer", inner_steps=plan.inner_steps, verify=False)
    config = replace(config, "pipeline", stages=plan.stages)
    config = replace(config, "data", batch_size=plan.batch_size, seq_len=plan.seq_len)
    floor = plan.anchor_mbit / 2
    return replace(config, "network", anchor_min_up_mbps=floor, anchor_min_down_mbps=floor, **LAB_NETWORK)


@dataclass
class Resources:
    """Samples of one daemon's process tree: (unix time, RSS MB) and (unix time, open fds)."""

    rss_mb: list[tuple[float, float]] = field(default_factory=list)
    fds: list[tuple[float, float]] = field(default_factory=list)


def process_tree(pid: int) -> list[int]:
    """`pid` and its descendants (a daemon and its p2pd), from /proc."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            with contextlib.suppress(OSError, ValueError, IndexError):
                stat = Path(f"/proc/{entry}/stat").read_text()
                parent = int(stat.rsplit(")", 1)[1].split()[1])
                children.setdefault(parent, []).append(int(entry))
    out, todo = [], [pid]
    while todo:
        current = todo.pop()
        out.append(current)
        todo.extend(children.get(current, []))
    return out


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
        host = self.lab.hosts["coordinator"]
        argv = [*HETNODE, "bootstrap", "--config", str(self.config_path)]
        argv += ["--data-dir", str(self.work / "coordinator"), "--http-port", "off", "--metrics-port", "0"]
        argv += ["--listen", f"/ip4/{host.address}/tcp/{COORDINATOR_PORT}"]
        process = self._launch("coordinator", argv, host.prefix)
        process.wait_ready(180.0)
        self.coordinator_maddr = process.maddr

    def start_peer(self, name: str) -> LabProcess:
        host = self.lab.hosts[name]
        anchor = name.startswith("anchor")
        link = self.plan.profile(name)
        rates = [r for r in (link.up_mbit, link.down_mbit) if r is not None]
        # it declares what its link carries (the slower way), as a volunteer's probe would find
        rate = min(rates) if rates else (self.plan.anchor_mbit if anchor else self.plan.stage_mbit)
        argv = [*HETNODE, "join", "--peer", self.coordinator_maddr, "--name", name]
        argv += ["--role", "anchor" if anchor else "stage", "--bandwidth", f"{rate:g}"]
        argv += ["--listen", f"/ip4/{host.address}/tcp/0", "--data-dir", str(self.work / name)]
        argv += ["--metrics-port", "0"]
        return self._launch(name, argv, host.prefix)

    def wait_ready(self, name: str) -> None:
        process = self.processes[name]
        self.peer_ids[name] = process.wait_ready(240.0)["peer_id"]
        said = [line for line in process.lines if line.startswith("reachability:")]
        if said:
            self.reachability[name] = said[0]

    def _launch(self, name: str, argv: list[str], prefix: list[str]) -> LabProcess:
        log = self.work / f"{name}.log"
        if log.exists():  # a restart: keep the earlier life's log next to the new one
            log.rename(self.work / f"{name}.{int(time.time())}.log")
        process = LabProcess(name, argv, log, prefix + ONE_THREAD, detach=True)
        self.processes[name] = process
        lives = sum(key.split("#")[0] == name for key in self.resources)
        self.life[name] = name if lives == 0 else f"{name}#{lives + 1}"
        self.resources[self.life[name]] = Resources()
        return process

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
        order = sorted(self.processes, key=lambda name: name == "coordinator")
        stopping = [self.processes.pop(name) for name in order]
        stop_all([p for p in stopping if p.name != "coordinator"], STOP_GRACE_S)
        stop_all([p for p in stopping if p.name == "coordinator"], STOP_GRACE_S)
        self.retired.extend(stopping)
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


def live_times(log: Path, now: float | None = None) -> list[float]:
    """Unix times at which a stage's log says its chain went live."""
    return log_times(log, LIVE_LINE, now)


def log_times(log: Path, pattern: str, now: float | None = None) -> list[float]:
    """Unix times of the log lines matching `pattern` (a regex). Log lines carry the local time of day
    only (hetnode/cli/main.py): a stamp later than `now` is yesterday's (runs are shorter than a day)."""
    now = time.time() if now is None else now
    today = datetime.datetime.fromtimestamp(now).date()
    matcher = re.compile(pattern)
    out = []
    for line in log.read_text(errors="replace").splitlines() if log.exists() else []:
        if matcher.search(line):
            with contextlib.suppress(ValueError):
                clock = datetime.datetime.strptime(line[:8], LOG_TIME).time()
                stamp = datetime.datetime.combine(today, clock).timestamp()
                out.append(stamp - 86400 if stamp > now + 60 else stamp)
    return out


def role_changes(work: Path, name: str) -> list[float]:
    """When daemon `name` (any of its lives) took a role: each is a new warm-up (a stage loads its slice
    and optimiser, an anchor the whole model)."""
    logs = [work / f"{name}.log", *work.glob(f"{name}.*.log")]
    return sorted(t for log in logs for t in log_times(log, ROLE_CHANGE))


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


def _credited(ledger: Path) -> dict[int, set[str]]:
    out: dict[int, set[str]] = {}
    with contextlib.closing(sqlite3.connect(f"file:{ledger}?mode=ro", uri=True)) as db:
        for round_, peer in db.execute("SELECT round, peer FROM contributions"):
            out.setdefault(round_, set()).add(peer)
    return out


def summarise(soak: Soak, config: Config, plan: SoakPlan, left: dict[str, list]) -> dict[str, Any]:
    history = soak.history()
    checks = [c for sample in soak.digests for c in sample["checks"]]
    ledger_path = soak.work / "coordinator" / LEDGER
    mismatches = (
        soak_checks.ledger_mismatches(history, _credited(ledger_path)) if ledger_path.exists() else None
    )
    names = {key.split("#")[0] for key in soak.resources} - {"coordinator"}
    logs = {name: read_rounds(soak.work / name) for name in names}
    boundary_s = config.network.boundary_s
    reform = None
    died = next((e for e in soak.events if e["kind"] == "chain-member-dies" and "skipped" not in e), None)
    if died is not None:
        live = {}
        for log in soak.work.glob("stage-*.log"):
            name = log.name.split(".")[0]
            if name != died["target"]:
                after = [t for t in live_times(log) if t > died["time"]]
                if after:
                    live[name] = min(after + [live.get(name, float("inf"))])
        complete = sorted(live.values())[plan.stages - 1 : plan.stages]  # the chain's last member live
        reform = soak_checks.boundaries_to_reform(died["time"], complete, boundary_s)
    catch_up, contributing = returns(soak.events, soak.work)
    per_profile: dict[str, list[float]] = {}  # a replica's rounds: from one announcement to the next
    sync_per_profile: dict[str, list[float]] = {}  # its sync: from announcing to having applied the round
    for name, records in logs.items():
        profile = describe(plan.profile(name))
        times = sorted(r["time"] for r in records)
        per_profile.setdefault(profile, []).extend(b - a for a, b in zip(times, times[1:], strict=False))
        synced = [r["seal_wait_s"] + r["apply_s"] for r in records if r.get("included")]
        sync_per_profile.setdefault(profile, []).extend(synced)
    resources = judge_resources(soak.resources, soak.work, plan)
    return {
        "plan": asdict(plan),
        "config": config.run.name,
        "rounds_sealed": len(history),
        "last_round": history[-1]["round"] if history else None,
        "churn_events": soak.events,
        "digest_checks": len(checks),
        "digest_disagreements": sum(c["verdict"] in ("disagrees", "half-applied") for c in checks),
        "half_applied_rounds": sum(c["verdict"] == "half-applied" for c in checks),
        "disagreeing": [c for c in checks if c["verdict"] in ("disagrees", "half-applied")],
        "ledger_mismatches": None if mismatches is None else len(mismatches),
        "ledger_mismatch_rounds": mismatches,
        "chain_reform_boundaries": reform,
        "catch_up_rounds": catch_up,  # to the swarm's θ (None: a spare stage with no chain to train in)
        "contributing_after_rounds": contributing,  # to its first sealed round
        "seal_interval_s": soak_checks.quantiles(soak_checks.round_times(history)),
        "round_time_s_per_profile": {k: soak_checks.quantiles(v) for k, v in per_profile.items()},
        "sync_s_per_profile": {k: soak_checks.quantiles(v) for k, v in sync_per_profile.items()},
        "far_round_ratio": _far_round_ratio(plan, per_profile),
        "rss_slope_mb_per_hour": _worst(resources, "rss_slope_mb_per_hour"),
        "fd_slope_per_hour": _worst(resources, "fd_slope_per_hour"),
        "rss_growth_per_hour": _worst(resources, "rss_growth_per_hour"),
        "fd_growth_per_hour": _worst(resources, "fd_growth_per_hour"),
        "resources": resources,
        "left_behind": left,
        "nat_peer_contributed": any(
            soak.peer_ids.get(NAT_ANCHOR) in entry["contributors"] for entry in history
        ),
        "reachability": soak.reachability,
    }


def judge_resources(lives: dict[str, Resources], work: Path, plan: SoakPlan) -> dict[str, dict[str, Any]]:
    """Per daemon life: its samples, and the slopes of RSS and fds on its longest stretch in one role after
    that stretch's warm-up (a role change is a new warm-up: a stage loads its slice and optimiser)."""
    out = {}
    for life, samples in lives.items():
        rss, fds = soak_checks.steady_stretch(
            samples.rss_mb,
            samples.fds,
            role_changes(work, life.split("#")[0]),
            plan.warmup_s,
            MIN_SLOPE_SPAN_S,
        )
        out[life] = {
            "rss_mb": samples.rss_mb,
            "fds": samples.fds,
            "judged_from": rss[0][0] if rss else None,
            "judged_to": rss[-1][0] if rss else None,
            "rss_slope_mb_per_hour": soak_checks.slope_per_hour(rss),
            "rss_growth_per_hour": soak_checks.growth_per_hour(rss),
            "fd_slope_per_hour": soak_checks.slope_per_hour(fds),
            "fd_growth_per_hour": soak_checks.growth_per_hour(fds),
        }
    return out


def rejudge(out: Path) -> dict[str, Any]:
    """Recompute a finished run's judgements that come from its logs and samples (catch-up, resources)
    with this code, in `out/soak.json`; what only the live run could observe (digests) stays as it was."""
    report = json.loads((out / "soak.json").read_text())
    plan = SoakPlan(**{**report["plan"], "wan": tuple(tuple(pair) for pair in report["plan"]["wan"])})
    work = out / "work"
    lives = {
        life: Resources([tuple(s) for s in v["rss_mb"]], [tuple(s) for s in v["fds"]])
        for life, v in report["resources"].items()
    }
    report["catch_up_rounds"], report["contributing_after_rounds"] = returns(report["churn_events"], work)
    report["resources"] = resources = judge_resources(lives, work, plan)
    for key in ("rss_slope_mb_per_hour", "fd_slope_per_hour", "rss_growth_per_hour", "fd_growth_per_hour"):
        report[key] = _worst(resources, key)
    return report


def returns(events: list[dict[str, Any]], work: Path) -> tuple[dict[str, int | None], dict[str, int | None]]:
    """Per return (a join, restart or link back up): rounds until the peer held the swarm's θ, and until
    its first sealed round, from its round log under `work`."""
    catch_up: dict[str, int | None] = {}
    contributing: dict[str, int | None] = {}
    for event in events:
        if event["kind"] in ("restart", "join", "link-up"):
            label, records = f"{event['kind']} {event['target']}", read_rounds(work / event["target"])
            catch_up[label] = soak_checks.catch_up_rounds(records, event["time"], event["sealed"])
            contributing[label] = soak_checks.contributing_rounds(records, event["time"], event["sealed"])
    return catch_up, contributing


def _far_round_ratio(plan: SoakPlan, per_profile: dict[str, list[float]]) -> float | None:
    """Median round of the replicas at the highest RTT over the median round of the LAN anchors."""
    far = max((plan.profile(name) for name, _ in plan.wan), key=lambda p: p.rtt_ms, default=None)
    lan = per_profile.get(describe(plan.profile("anchor-1")))
    far_rounds = per_profile.get(describe(far)) if far is not None else None
    if not lan or not far_rounds:
        return None
    return statistics.median(far_rounds) / statistics.median(lan)


def _worst(resources: dict[str, dict[str, Any]], key: str) -> float | None:
    values = [r[key] for r in resources.values() if r[key] is not None]
    return max(values) if values else None


def write_report(report: dict[str, Any], out: Path) -> tuple[Path, Path]:
    """`soak.json` and `soak.png` (sealed rounds with the churn marked, RSS and fds per daemon life, round
    times per link profile)."""
    out.mkdir(parents=True, exist_ok=True)
    json_path, png_path = out / "soak.json", out / "soak.png"
    json_path.write_text(json.dumps(report, indent=1))
    fig, axes = plt.subplots(1, 4, figsize=(22, 5))
    events = report["churn_events"]
    start = events[0]["time"] if events else 0.0
    minutes = lambda t: (t - start) / 60  # noqa: E731 - a local shorthand
    axes[0].plot([minutes(e["time"]) for e in events], [e["sealed"] for e in events], "k.", alpha=0.3)
    for event in events:
        if event["kind"] not in ("start", "end"):
            axes[0].axvline(minutes(event["time"]), color="tab:red", alpha=0.3)
            axes[0].text(
                minutes(event["time"]),
                0,
                f" {event['kind']} {event['target']}",
                rotation=90,
                fontsize=7,
                va="bottom",
            )
    axes[0].set(
        title=f"rounds sealed ({report['rounds_sealed']}) and churn", xlabel="minutes", ylabel="round"
    )
    for life, usage in report["resources"].items():
        if usage["rss_mb"]:
            axes[1].plot(
                [minutes(t) for t, _ in usage["rss_mb"]], [v for _, v in usage["rss_mb"]], label=life
            )
            axes[2].plot([minutes(t) for t, _ in usage["fds"]], [v for _, v in usage["fds"]], label=life)
    axes[1].set(title="RSS per daemon (with its p2pd), MB", xlabel="minutes")
    axes[2].set(title="open fds per daemon (with its p2pd)", xlabel="minutes")
    axes[1].legend(fontsize=6)
    profiles = {k: v for k, v in report["round_time_s_per_profile"].items() if v}
    axes[3].bar(list(profiles), [v["p50"] for v in profiles.values()], color="tab:blue", label="median")
    axes[3].bar(
        list(profiles),
        [v["p90"] - v["p50"] for v in profiles.values()],
        bottom=[v["p50"] for v in profiles.values()],
        color="tab:orange",
        label="to p90",
    )
    axes[3].set(title="seconds per round, per link profile")
    axes[3].tick_params(axis="x", labelrotation=15, labelsize=7)
    axes[3].legend(fontsize=7)
    fig.suptitle(
        f"hetnode bench soak: {report['config']}, {report['plan']['minutes']:g} min, "
        f"{report['digest_disagreements']} digest disagreements, "
        f"{report['ledger_mismatches']} ledger mismatches"
    )
    fig.tight_layout()
    fig.savefig(png_path, dpi=100)
    plt.close(fig)
    return json_path, png_path
