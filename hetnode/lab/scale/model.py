"""`hetnode bench scale`: the sync plane at R = 8..256 replicas, simulated (docs/scale.md, issue 17).

No networking. Payload sizes come from the real codec (`hetnode/lab/scale/sizes.py`); the swarm is a
documented mix of anchors and chains (`swarm_at`); one round's transfers are played through a fluid model
of every peer's links (`hetnode/lab/scale/fluid.py`) in four modes (`hetnode/lab/scale/schedules.py`):
- `hub`: the code before b80d0c7: every replica fetched every sealed payload from the coordinator, which
  uploaded R·(R−1)·p.
- `any-holder`: the code since b80d0c7. The coordinator validates each payload from its author and seals;
  every replica then fetches each sealed payload from its author (the only holder at seal time), so a
  stage's uplink carries its slice once to the coordinator and R−1 times to fetchers. The coordinator
  serves seals only, and is the fallback. Its rows also carry `daemon`: the same fetch as
  `hetnode/daemon/payload_fetch.py` paces it (8 batches in flight per fetcher, each fetcher in its own
  order, a holder passed over when it stalls, the sealer for what stalled), played out per peer by
  `hetnode/lab/scale/fetch.py`.
- `seeded`: planned. A stage uploads its payload once, to a seed anchor, from which the coordinator
  validates it and stages fetch.
- `tiles`: planned past the crossover R*: reduce-scatter to anchors, all-gather of a dense aggregate.
Control-plane bytes (DHT records, heartbeats, polls) are modelled in `hetnode/lab/scale/control.py`.
The model, its assumptions and its results: docs/scale.md. Results: `scale.json` and `scale.png`.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from tqdm import tqdm  # noqa: E402

from hetnode.config import Config  # noqa: E402
from hetnode.errors import ConfigError  # noqa: E402
from hetnode.lab.scale import control as scale_control  # noqa: E402
from hetnode.lab.scale.fetch import QUANTUM_OF_LIMIT, daemon_fetch  # noqa: E402
from hetnode.lab.scale.fluid import link_seconds, simulate  # noqa: E402
from hetnode.lab.scale.pace import PACE_CONFIGS, pace_report  # noqa: E402
from hetnode.lab.scale.schedules import (  # noqa: E402
    MODES,
    SEALED_DOWNLOADS,
    Links,
    Swarm,
    schedule,
    swarm_at,
)
from hetnode.lab.scale.sizes import (  # noqa: E402
    PayloadSizes,
    crossover,
    payload_sizes,
    seal_bytes,
)

__all__ = ["MODES", "Links", "ScalePlan", "Swarm", "crossover", "plan_for", "run_benchmark", "swarm_at"]
# the control plane each mode runs with: the hub is the code before any-holder fetch and before the
# heartbeats stretched; any-holder is the code now (reads vouched for by the coordinator's head); seeded
# and tiles are planned, with the target's
CONTROL_SCHEME = {"hub": "today", "any-holder": "vouched", "seeded": "target", "tiles": "target"}
DAEMON = "any-holder (daemon)"  # the any-holder rows' `daemon` fields, as a mode of their own in targets


@dataclass(frozen=True)
class ScalePlan:
    replicas: tuple[int, ...]
    configs: tuple[str, ...]
    modes: tuple[str, ...] = MODES
    anchor_share: float = 0.5  # of the R replicas; the rest are chains of `pipeline.stages` stages
    prefetch: bool = False  # any-holder and seeded: fetch announced payloads before the seal (docs/scale.md)
    drop_tail: bool = False  # any-holder: slow holders' flows starved at full downlinks (`schedule`)
    links: Links = field(default_factory=Links)
    control: scale_control.ControlModel = field(default_factory=scale_control.ControlModel)


def plan_for(quick: bool, anchor_share: float = 0.5, prefetch: bool = False) -> ScalePlan:
    if not 0 < anchor_share <= 1:
        raise ConfigError("--anchor-share", "bench scale", f"must be in (0, 1], got {anchor_share}")
    if quick:
        return ScalePlan((8, 16, 64), ("small", "178m"), anchor_share=anchor_share, prefetch=prefetch)
    grid = (8, 16, 32, 64, 128, 256)
    return ScalePlan(grid, ("small", "178m", "1b"), anchor_share=anchor_share, prefetch=prefetch)


# --- one round, the whole grid, the report --------------------------------------------------------------


def simulate_round(mode: str, sizes: PayloadSizes, swarm: Swarm, plan: ScalePlan) -> dict:
    """One (config, R, mode) row: bytes per role, the round's sync time and its physical limit, control."""
    groups, transfers = schedule(mode, sizes, swarm, plan.links, plan.prefetch, plan.drop_tail)
    timeline = simulate(groups, transfers)
    limits = link_seconds(groups, transfers)
    busiest = max(limits, key=limits.__getitem__)
    seal_s = timeline.finish_s["seal"]

    def per_peer(group: str, direction: str) -> float:
        side = "src" if direction == "up" else "dst"
        return sum(t.nbytes for t in transfers if getattr(t, side) == group) / groups[group].count

    def fetched_by(group: str) -> float:
        """From the seal to the group's last sealed byte in."""
        ends = [
            timeline.finish_s[t.name]
            for t in transfers
            if t.dst == group and t.name.startswith(SEALED_DOWNLOADS)
        ]
        return max(ends, default=seal_s) - seal_s

    stages = [f"stage{s}" for s in range(swarm.stages)] if swarm.chains else []
    stage_download = [per_peer(stage, "down") for stage in stages]
    slices = [(swarm.replicas - 1) * sizes.stage_bytes(s) for s in range(len(stages))]
    records = scale_control.record_sizes(
        list(sizes.shard_bytes),
        list(sizes.stage_shards),
        swarm.anchors,
        swarm.chains,
        seal_bytes(sizes, swarm.anchors, swarm.chains),
    )
    authors = swarm.peers - 1
    scheme = CONTROL_SCHEME[mode]
    if scheme == "today":
        control = scale_control.today(swarm.peers, authors, records, seal_s, plan.control)
    elif scheme == "stretched":
        control = scale_control.stretched(swarm.peers, authors, records, seal_s, plan.control)
    elif scheme == "vouched":
        control = scale_control.vouched(swarm.peers, authors, records, seal_s, plan.control)
        # beside it: the code before the head vouched for views, and the code under churn
        before = scale_control.stretched(swarm.peers, authors, records, seal_s, plan.control)
        churn = scale_control.vouched(swarm.peers, authors, records, seal_s, plan.control, churn=True)
    else:
        control = scale_control.target(swarm.peers, authors, swarm.stages, records, plan.control)
    row = {
        "config": sizes.config,
        "replicas": swarm.replicas,
        "mode": mode,
        "anchors": swarm.anchors,
        "chains": swarm.chains,
        "peers": swarm.peers,
        "coordinator_egress_bytes": per_peer("coordinator", "up"),
        "coordinator_ingress_bytes": per_peer("coordinator", "down"),
        "stage_download_bytes": max(stage_download, default=0.0),
        "stage_download_bytes_by_stage": stage_download,
        # what the target allows a stage: 1.2 × (R − 1) × its slice's share of p
        "stage_download_over_slice": max(
            (d / n for d, n in zip(stage_download, slices, strict=True)), default=None
        ),
        "stage_upload_bytes": max((per_peer(stage, "up") for stage in stages), default=0.0),
        "anchor_download_bytes": per_peer("anchors", "down"),
        "anchor_upload_bytes": per_peer("anchors", "up"),
        "seal_s": seal_s,
        "fetch_s": {group: fetched_by(group) for group in ("anchors", *stages)},
        "round_s": timeline.makespan_s,
        "round_limit_s": limits[busiest],
        "busiest_link": f"{busiest[0]} {busiest[1]}",
        "control_scheme": scheme,
        "control_bytes_per_peer": control.per_peer,
        "control_bytes_hot_peer": control.hot_peer,
    }
    if scheme == "vouched":
        row["control_bytes_per_peer_stretched"] = before.per_peer
        row["control_bytes_per_peer_churn"] = churn.per_peer
    if mode == "any-holder" and not plan.prefetch:  # the daemon fetches once it has the seal, never before
        row["daemon"] = _daemon(row, sizes, swarm, plan, timeline.finish_s, stage_download, slices)
    return row


def _daemon(
    row: dict,
    sizes: PayloadSizes,
    swarm: Swarm,
    plan: ScalePlan,
    finish_s: Mapping[str, float],
    stage_download: list[float],
    slices: list[float],
) -> dict:
    """The any-holder fetch as the daemon paces it (`scale_fetch.py`), once every fetcher has the seal.
    Rates are recomputed at most every QUANTUM_OF_LIMIT of the balanced round's limit (docs/scale.md)."""
    quantum_s = row["round_limit_s"] * QUANTUM_OF_LIMIT
    fetch = daemon_fetch(sizes, swarm, plan.links, quantum_s=quantum_s)
    sealed_read = max(t for name, t in finish_s.items() if name.startswith("seal:"))
    # the stage that downloaded most: its sealed payloads, what it fetched again after a stall, the seal
    fetched = [fetch.most_downloaded.get(f"stage{s}", 0.0) for s in range(len(slices))]
    return {
        "round_s": sealed_read + fetch.makespan_s,
        "fetch_s": {cls: sealed_read - row["seal_s"] + t for cls, t in fetch.fetch_s.items()},
        "coordinator_egress_bytes": row["coordinator_egress_bytes"] + fetch.fallback_bytes,
        "fallback_bytes": fetch.fallback_bytes,
        "requests": fetch.requests,
        "timed_out": fetch.timed_out,
        "wasted_bytes": sum(fetch.wasted_bytes.values()),
        # a stalled batch is dropped whole, what came in included, and fetched again from the sealer
        "stage_download_over_slice": max(
            ((d - n + got) / n for d, got, n in zip(stage_download, fetched, slices, strict=True)),
            default=None,
        ),
        "failed": fetch.failed,
        "quantum_s": quantum_s,
    }


def lab_check(config: Config) -> dict:
    """Today's control model in the network lab's setting (tiny; coordinator, 2 anchors, a chain of 2;
    2 s heartbeat; 10.4 s rounds), next to what the lab measured on an anchor's interface: 1.20 MB a round,
    control, payloads (about 70 KB) and TCP/IP together (BENCHMARKS.md, the network lab)."""
    sizes = payload_sizes(config)
    control = scale_control.ControlModel(round_period_s=10.4, heartbeat_s=2.0)
    records = scale_control.record_sizes(
        list(sizes.shard_bytes), list(sizes.stage_shards), 2, 1, seal_bytes(sizes, 2, 1)
    )
    modelled = scale_control.today(5, 4, records, 0.5, control)
    return {
        "config": config.run.name,
        "modelled_per_peer_bytes": modelled.per_peer,
        "lab_anchor_wire_bytes": 1.20e6,
    }


def targets(rows: list[dict], plan: ScalePlan, sizes: Mapping[str, PayloadSizes]) -> dict:
    """The issue's targets, each as (value, limit, met), per config and mode; `any-holder (daemon)` is the
    any-holder rows with the daemon's pacing (their `daemon` fields)."""
    daemon = [
        {
            **r,
            **{
                k: r["daemon"][k]
                for k in ("coordinator_egress_bytes", "round_s", "stage_download_over_slice")
            },
        }
        | {"mode": DAEMON}
        for r in rows
        if r.get("daemon")
    ]
    out: dict[str, dict] = {}
    for name, s in sizes.items():
        out[name] = {}
        for mode in (*plan.modes, DAEMON):
            mine = [r for r in rows + daemon if r["config"] == name and r["mode"] == mode]
            if mine:
                out[name][mode] = _checks(mine, plan, s)
    return out


def _checks(rows: list[dict], plan: ScalePlan, s: PayloadSizes) -> dict:
    by_r = {r["replicas"]: r for r in rows}
    at64, low, high = by_r.get(64), by_r.get(min(plan.replicas)), by_r.get(max(plan.replicas))
    checks: dict[str, dict] = {}
    if at64:
        egress = at64["coordinator_egress_bytes"] / (2 * 64 * s.payload_bytes)
        checks["coordinator_egress_over_2Rp_at_64"] = {"value": egress, "limit": 1.0, "met": egress <= 1.0}
        ratio = at64["round_s"] / at64["round_limit_s"]
        checks["round_over_limit_at_64"] = {"value": ratio, "limit": 1.5, "met": ratio <= 1.5}
    worst = max((r["stage_download_over_slice"] for r in rows if r["chains"]), default=None)
    if worst is not None:
        checks["stage_download_over_slice"] = {"value": worst, "limit": 1.2, "met": worst <= 1.2}
    if low and high and low is not high:
        growth = high["control_bytes_per_peer"] / low["control_bytes_per_peer"]
        allowed = math.log(high["peers"]) / math.log(low["peers"])
        checks["control_growth"] = {
            "value": growth,
            "limit": allowed,
            "met": growth <= allowed,
            "peers": [low["peers"], high["peers"]],
        }
        if "control_bytes_per_peer_churn" in high:  # the same with 2 % of peers changing each round
            growth = high["control_bytes_per_peer_churn"] / low["control_bytes_per_peer_churn"]
            checks["control_growth_churn"] = {"value": growth, "limit": allowed, "met": growth <= allowed}
    return checks


def run_benchmark(
    configs: Mapping[str, Config],
    plan: ScalePlan,
    out_dir: Path,
    progress: bool = True,
    lab: Config | None = None,
) -> dict:
    out_dir.mkdir(parents=True, exist_ok=True)
    sizes = {name: payload_sizes(configs[name]) for name in plan.configs}
    grid = [(name, r, mode) for name in plan.configs for r in plan.replicas for mode in plan.modes]
    rows = []
    for name, r, mode in tqdm(grid, desc="scale", unit="round", disable=not progress):
        swarm = swarm_at(r, configs[name].pipeline.stages, plan.anchor_share)
        rows.append(simulate_round(mode, sizes[name], swarm, plan))
    report = {
        "plan": asdict(plan),
        "configs": {
            name: {
                "parameters": s.parameters,
                "payload_bytes": s.payload_bytes,
                "stage_shards": s.stage_shards,
                "stage_payload_bytes": [s.stage_bytes(i) for i in range(len(s.stage_shards))],
                "crossover_R": crossover(s),
                "crossover_R_simulated": _simulated_crossover(rows, name, "any-holder"),
                "crossover_R_simulated_seeded": _simulated_crossover(rows, name, "seeded"),
            }
            for name, s in sizes.items()
        },
        "rows": rows,
        "targets": targets(rows, plan, sizes),
        # each round rule's anchor idle share beside chains (issue 35), on the smallest swarm with chains
        "pace": {
            name: pace_report(configs[name], s.parameters, row, plan.links.stage_mbit)
            for name, s in sizes.items()
            if name in PACE_CONFIGS and (row := _smallest_with_chains(rows, name)) is not None
        },
        "lab_check": lab_check(lab) if lab is not None else None,
    }
    (out_dir / "scale.json").write_text(json.dumps(report, indent=2))
    plot(report, out_dir / "scale.png")
    return report


def _smallest_with_chains(rows: list[dict], name: str) -> dict | None:
    """The any-holder row of `name` at the smallest R with chains (the smallest R when none has; None
    without any-holder rows)."""
    mine = sorted(
        (r for r in rows if r["config"] == name and r["mode"] == "any-holder"), key=lambda r: r["replicas"]
    )
    return next((r for r in mine if r["chains"]), mine[0] if mine else None)


def _simulated_crossover(rows: list[dict], name: str, sparse: str) -> int | None:
    """The first simulated R at which the tile-range aggregation's round is shorter than `sparse`'s."""
    times = {(r["replicas"], r["mode"]): r["round_s"] for r in rows if r["config"] == name}
    wins = [r for (r, mode), t in times.items() if mode == "tiles" and t < times.get((r, sparse), -1.0)]
    return min(wins, default=None)


def _series(rows: list[dict], name: str, mode: str, key: str) -> list[tuple[int, float]]:
    """(R, value) of one config and mode; `any-holder (daemon)` reads the any-holder rows' daemon fields."""
    if mode == DAEMON:
        return [
            (r["replicas"], r["daemon"].get(key, r[key]))
            for r in rows
            if r["config"] == name and r.get("daemon")
        ]
    return [(r["replicas"], r[key]) for r in rows if r["config"] == name and r["mode"] == mode]


def plot(report: dict, path: Path) -> None:
    rows = report["rows"]
    configs = list(report["configs"])
    modes = sorted({r["mode"] for r in rows}, key=MODES.index)
    modes += [DAEMON] if "any-holder" in modes else []
    colors = dict(zip(configs, ("tab:blue", "tab:orange", "tab:green", "tab:red"), strict=False))
    styles = dict(zip((*MODES, DAEMON), ("-", "--", "-.", ":", "--"), strict=True))
    markers = {DAEMON: "x"}
    fig, axes = plt.subplots(2, 2, figsize=(14, 11))
    panels = (
        (axes[0][0], "coordinator_egress_bytes", "coordinator egress per round (bytes)"),
        (axes[0][1], "round_s", "sync time per round (s); thin: the busiest link's limit"),
        (
            axes[1][0],
            "stage_download_bytes",
            "largest stage's download per round (bytes; hub = any-holder = seeded)",
        ),
    )
    for ax, key, title in panels:
        for name in configs:
            for mode in modes:
                pts = _series(rows, name, mode, key)
                if not any(y > 0 for _, y in pts):  # a swarm without chains has no stage download
                    continue
                if key == "stage_download_bytes" and mode == DAEMON:
                    continue  # the same bytes, but for partial payloads that timed out
                xs, ys = zip(*pts, strict=True)
                style = dict(color=colors[name], marker=markers.get(mode, "o"), markersize=4)
                ax.plot(xs, ys, styles[mode], label=f"{name} {mode}", **style)
                if key == "round_s" and mode != DAEMON:
                    limit = [y for _, y in _series(rows, name, mode, "round_limit_s")]
                    ax.plot(xs, limit, styles[mode], color=colors[name], linewidth=0.6)
        ax.set(xscale="log", yscale="log", xlabel="replicas R", title=title)
        ax.grid(True, which="both", alpha=0.3)
    for name in configs:  # the bound on the coordinator's egress
        p = report["configs"][name]["payload_bytes"]
        xs = sorted({r["replicas"] for r in rows})
        axes[0][0].plot(xs, [2 * x * p for x in xs], color=colors[name], linewidth=0.6, alpha=0.6)
    axes[0][0].legend(fontsize=6, ncol=3, title="thin: 2·R·p", title_fontsize=7)
    axes[0][1].legend(fontsize=6, ncol=3)
    ax = axes[1][1]
    for name in configs:
        for mode, scheme in (("hub", "today (hub, any-holder)"), ("seeded", "target (seeded, tiles)")):
            pts = [
                (r["peers"], r["control_bytes_per_peer"])
                for r in rows
                if r["config"] == name and r["mode"] == mode
            ]
            if pts:
                xs, ys = zip(*pts, strict=True)
                ax.plot(xs, ys, styles[mode], color=colors[name], marker="o", label=f"{name} {scheme}")
    ax.set(xscale="log", yscale="log", xlabel="peers in the swarm", title="control bytes per peer per round")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7)
    fig.suptitle("hetnode bench scale: the sync plane, simulated (docs/scale.md)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
