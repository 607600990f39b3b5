"""The report of `hetnode bench soak` (`soak.py` runs it): digest disagreements, half-applied rounds, ledger
mismatches, chain re-forming and catch-up times, round times per link profile and resource slopes, read from
the run's samples and its daemons' logs (`soak_checks.py` holds the arithmetic); `soak.json` and `soak.png`.
`rejudge` recomputes what comes from logs and samples for a finished run."""

from __future__ import annotations

import contextlib
import datetime
import json
import re
import sqlite3
import statistics
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Protocol

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from hetnode.config import Config  # noqa: E402
from hetnode.lab.netlab.wan import describe  # noqa: E402
from hetnode.lab.runs import soak_checks  # noqa: E402
from hetnode.lab.runs.soak_plan import NAT_ANCHOR, SoakPlan  # noqa: E402
from hetnode.lab.scale.lab_runs import read_rounds  # noqa: E402

MIN_SLOPE_SPAN_S = 600.0  # a life's samples after its warm-up must span this much for a slope
LEDGER = "ledger.sqlite"
LIVE_LINE = " live: stage "
ROLE_CHANGE = r" live: stage |boundary \d+: role |: class \w+, role "  # hetnode/daemon/peer.py's lines
LOG_TIME = "%H:%M:%S"


@dataclass
class Resources:
    """Samples of one daemon's process tree: (unix time, RSS MB) and (unix time, open fds)."""

    rss_mb: list[tuple[float, float]] = field(default_factory=list)
    fds: list[tuple[float, float]] = field(default_factory=list)


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


def _credited(ledger: Path) -> dict[int, set[str]]:
    out: dict[int, set[str]] = {}
    with contextlib.closing(sqlite3.connect(f"file:{ledger}?mode=ro", uri=True)) as db:
        for round_, peer in db.execute("SELECT round, peer FROM contributions"):
            out.setdefault(round_, set()).add(peer)
    return out


class SoakRecord(Protocol):
    """What a finished soak (`soak.py` `Soak`) hands its report: its folder, the churn it caused, each
    daemon life's resources, the digest checks and the coordinator's sealed history."""

    work: Path
    events: list[dict[str, Any]]
    resources: dict[str, Resources]
    digests: list[dict[str, Any]]

    def history(self) -> list[dict[str, Any]]: ...


def summarise(soak: SoakRecord, config: Config, plan: SoakPlan, left: dict[str, list]) -> dict[str, Any]:
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
