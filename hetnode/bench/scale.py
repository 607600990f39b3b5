"""`hetnode bench scale`: the sync plane at R = 8..256 replicas, simulated (TRUST §6, issue 17).

No networking. Payload sizes come from the real codec (`hetnode/bench/scale_sizes.py`); the swarm is a
documented mix of anchors and chains (`swarm_at`); one round's transfers are played through a fluid model
of every peer's links (`hetnode/bench/fluid.py`) in three modes:
- `hub`: today's code. The coordinator fetches every payload from its author to validate it, seals, and
  every replica fetches the sealed payloads of the shards it holds from the coordinator (a chain stage only
  its slice's). The coordinator uploads R·(R−1)·p.
- `any-holder`: payloads are content-addressed and author-signed, so anyone holding one may serve it. A
  stage uploads its payload once, to a seed anchor, from which the coordinator validates it; after the
  seal every anchor fetches what it lacks from the author anchors and the seeds, and every stage fetches
  its slice from the anchors, spread evenly. The coordinator downloads R·p and pushes the seal.
- `tiles`: the planned step past the crossover R*. Authors push each tile range of their payload to the
  anchor that aggregates it (reduce-scatter); after the seal each replica fetches the dense bf16 aggregate
  of its shards from the aggregators (all-gather).
Control-plane bytes (DHT records, heartbeats, polls) are modelled in `hetnode/bench/scale_control.py`.
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

from hetnode.bench import scale_control  # noqa: E402
from hetnode.bench.fluid import NodeGroup, Transfer, link_seconds, simulate  # noqa: E402
from hetnode.bench.scale_sizes import (  # noqa: E402
    DENSE_AGGREGATE_BYTES_PER_PARAM,
    PayloadSizes,
    crossover,
    payload_sizes,
    seal_bytes,
)
from hetnode.config import Config  # noqa: E402
from hetnode.errors import ConfigError  # noqa: E402

MODES = ("hub", "any-holder", "tiles")
MBIT = 1e6 / 8  # bytes/s


@dataclass(frozen=True)
class Links:
    anchor_mbit: float = 1000.0  # up and down
    stage_mbit: float = 20.0
    coordinator_mbit: float = 1000.0
    rtt_s: float = 0.05


@dataclass(frozen=True)
class ScalePlan:
    replicas: tuple[int, ...]
    configs: tuple[str, ...]
    modes: tuple[str, ...] = MODES
    anchor_share: float = 0.5  # of the R replicas; the rest are chains of `pipeline.stages` stages
    prefetch: bool = False  # any-holder: replicas fetch announced payloads before the seal (docs/scale.md)
    links: Links = field(default_factory=Links)
    control: scale_control.ControlModel = field(default_factory=scale_control.ControlModel)


def plan_for(quick: bool, anchor_share: float = 0.5, prefetch: bool = False) -> ScalePlan:
    if not 0 < anchor_share <= 1:
        raise ConfigError("--anchor-share", "bench scale", f"must be in (0, 1], got {anchor_share}")
    if quick:
        return ScalePlan((8, 16, 64), ("small", "178m"), anchor_share=anchor_share, prefetch=prefetch)
    grid = (8, 16, 32, 64, 128, 256)
    return ScalePlan(grid, ("small", "178m", "1b"), anchor_share=anchor_share, prefetch=prefetch)


# --- the swarm and one round's transfers ----------------------------------------------------------------


@dataclass(frozen=True)
class Swarm:
    anchors: int
    chains: int
    stages: int  # per chain

    @property
    def replicas(self) -> int:
        return self.anchors + self.chains

    @property
    def peers(self) -> int:
        """Everyone in the DHT: anchors, every chain's stages, the coordinator."""
        return self.anchors + self.chains * self.stages + 1


def swarm_at(replicas: int, stages: int, anchor_share: float) -> Swarm:
    """R replicas: round(share·R) anchors (at least one: they carry the any-holder backbone), the rest
    chains of `stages` stages."""
    anchors = min(replicas, max(1, round(anchor_share * replicas)))
    return Swarm(anchors, replicas - anchors, stages)


def schedule(
    mode: str, sizes: PayloadSizes, swarm: Swarm, links: Links, prefetch: bool = False
) -> tuple[dict[str, NodeGroup], list[Transfer]]:
    """One round's groups of peers and transfers in `mode`, every replica having announced at t = 0.

    Every fetch starts one RTT after what it waits for (the request); the seal reaches peers half an RTT
    after the coordinator has validated the last payload (a nudge). CPU time (decode, check, aggregate) is
    left out: this is the network's share of a round. With `prefetch`, any-holder replicas fetch what was
    announced without waiting for the seal (which still gates applying the round)."""
    a, c, rtt = swarm.anchors, swarm.chains, links.rtt_s
    groups = {
        "coordinator": NodeGroup(
            "coordinator", 1, links.coordinator_mbit * MBIT, links.coordinator_mbit * MBIT
        ),
        "anchors": NodeGroup("anchors", a, links.anchor_mbit * MBIT, links.anchor_mbit * MBIT),
    }
    for s in range(swarm.stages) if c else ():
        groups[f"stage{s}"] = NodeGroup(f"stage{s}", c, links.stage_mbit * MBIT, links.stage_mbit * MBIT)
    # every mode: the coordinator fetches each payload once and checks it, then seals
    out = [Transfer("validate:anchors", "anchors", "coordinator", a * sizes.payload_bytes, a, delay_s=rtt)]
    if mode == "hub":
        out += _hub(sizes, swarm, rtt)
    elif mode == "any-holder":
        out += _any_holder(sizes, swarm, rtt, prefetch)
    elif mode == "tiles":
        out += _tiles(sizes, swarm, rtt)
    else:
        raise ValueError(f"unknown mode {mode!r}; expected one of {MODES}")
    return groups, out


def _seal(before: list[Transfer], rtt: float) -> Transfer:
    """The seal: once the coordinator has checked the anchors' payloads and the stages' in `before`."""
    validated = ("validate:anchors", *(t.name for t in before if t.name.startswith("validate:")))
    return Transfer("seal", "coordinator", "coordinator", 0, 1, validated, rtt / 2)


def _hub(sizes: PayloadSizes, swarm: Swarm, rtt: float) -> list[Transfer]:
    a, c, r, p = swarm.anchors, swarm.chains, swarm.replicas, sizes.payload_bytes
    seal = seal_bytes(sizes, a, c)
    stages = range(swarm.stages) if c else range(0)
    out = [
        Transfer(f"validate:stage{s}", f"stage{s}", "coordinator", c * sizes.stage_bytes(s), c, delay_s=rtt)
        for s in stages
    ]
    out.append(_seal(out, rtt))
    # every replica fetches the sealed payloads of the shards it holds, but its own, from the coordinator
    out.append(
        Transfer("fetch:anchors", "coordinator", "anchors", a * ((r - 1) * p + seal), a, ("seal",), rtt)
    )
    for s in stages:
        nbytes = c * ((r - 1) * sizes.stage_bytes(s) + seal)
        out.append(Transfer(f"fetch:stage{s}", "coordinator", f"stage{s}", nbytes, c, ("seal",), rtt))
    return out


def _any_holder(sizes: PayloadSizes, swarm: Swarm, rtt: float, prefetch: bool) -> list[Transfer]:
    a, c, p = swarm.anchors, swarm.chains, sizes.payload_bytes
    seal = seal_bytes(sizes, a, c)
    stages = range(swarm.stages) if c else range(0)
    out = []
    for s in stages:
        ps = sizes.stage_bytes(s)
        # a stage uploads its payload once, to a seed anchor (spread evenly), as soon as it announces; the
        # coordinator validates it from there: a stage's slow uplink never carries a payload twice
        out.append(Transfer(f"seed:stage{s}", f"stage{s}", "anchors", c * ps, c, delay_s=rtt))
        seeded = (f"seed:stage{s}",)
        out.append(Transfer(f"validate:stage{s}", "anchors", "coordinator", c * ps, c, seeded, rtt))
    out.append(_seal(out, rtt))
    # the coordinator pushes the seal to the anchors with its nudge; stages get it with their first payload
    out.append(Transfer("seal:anchors", "coordinator", "anchors", a * seal, a, ("seal",)))
    sealed = ("seal:anchors",)
    seeds = tuple(f"seed:stage{s}" for s in stages)
    if a > 1:  # anchors fetch the other anchors' payloads from their authors, the stages' from the seeds
        after = () if prefetch else sealed
        flows = a * (a - 1)
        out.append(Transfer("anchors:authors", "anchors", "anchors", flows * p, flows, after, rtt))
        if c:  # each anchor already holds the 1/a of the stage-authored bytes it seeded
            after = seeds if prefetch else sealed
            out.append(Transfer("anchors:seeds", "anchors", "anchors", c * p * (a - 1), flows, after, rtt))
    for s in stages:  # a stage fetches its slice of every other replica's payload from the anchors, evenly
        nbytes = c * ((swarm.replicas - 1) * sizes.stage_bytes(s) + seal)
        after = (f"seed:stage{s}",) if prefetch else sealed
        out.append(Transfer(f"fetch:stage{s}", "anchors", f"stage{s}", nbytes, c * a, after, rtt))
    return out


def _tiles(sizes: PayloadSizes, swarm: Swarm, rtt: float) -> list[Transfer]:
    a, c, p = swarm.anchors, swarm.chains, sizes.payload_bytes
    seal = seal_bytes(sizes, a, c)
    stages = range(swarm.stages) if c else range(0)
    dense = DENSE_AGGREGATE_BYTES_PER_PARAM
    # reduce-scatter: as soon as it announces, each author pushes tile range j of its payload to anchor j
    out = []
    for s in stages:
        ps = sizes.stage_bytes(s)
        out.append(Transfer(f"reduce:stage{s}", f"stage{s}", "anchors", c * ps, c * a, delay_s=rtt))
        # the coordinator collects a stage's ranges from the aggregators to validate the whole payload
        out.append(
            Transfer(
                f"validate:stage{s}", "anchors", "coordinator", c * ps, c * a, (f"reduce:stage{s}",), rtt
            )
        )
    if a > 1:  # an anchor keeps its own range of its own payload
        out.append(Transfer("reduce:anchors", "anchors", "anchors", p * (a - 1), a * (a - 1), delay_s=rtt))
    out.append(_seal(out, rtt))
    out.append(Transfer("seal:anchors", "coordinator", "anchors", a * seal, a, ("seal",)))
    after = ("seal:anchors", *(t.name for t in out if t.name.startswith("reduce:")))
    if a > 1:  # all-gather: each anchor fetches the other ranges of the dense aggregate
        gathered = dense * sizes.parameters * (a - 1)
        out.append(Transfer("gather:anchors", "anchors", "anchors", gathered, a * (a - 1), after, rtt))
    for s in stages:
        nbytes = c * (dense * sizes.stage_params(s) + seal)
        out.append(Transfer(f"gather:stage{s}", "anchors", f"stage{s}", nbytes, c * a, after, rtt))
    return out


# --- one round, the whole grid, the report --------------------------------------------------------------


def simulate_round(mode: str, sizes: PayloadSizes, swarm: Swarm, plan: ScalePlan) -> dict:
    """One (config, R, mode) row: bytes per role, the round's sync time and its physical limit, control."""
    groups, transfers = schedule(mode, sizes, swarm, plan.links, plan.prefetch)
    timeline = simulate(groups, transfers)
    limits = link_seconds(groups, transfers)
    busiest = max(limits, key=limits.__getitem__)

    def per_peer(group: str, direction: str) -> float:
        side = "src" if direction == "up" else "dst"
        return sum(t.nbytes for t in transfers if getattr(t, side) == group) / groups[group].count

    stage_download = [per_peer(f"stage{s}", "down") for s in range(swarm.stages)] if swarm.chains else []
    records = scale_control.record_sizes(
        list(sizes.shard_bytes),
        list(sizes.stage_shards),
        swarm.anchors,
        swarm.chains,
        seal_bytes(sizes, swarm.anchors, swarm.chains),
    )
    authors = swarm.peers - 1
    if mode == "hub":  # today's code, today's control plane
        control = scale_control.today(swarm.peers, authors, records, timeline.finish_s["seal"], plan.control)
    else:
        control = scale_control.target(swarm.peers, authors, swarm.stages, records, plan.control)
    r = swarm.replicas
    return {
        "config": sizes.config,
        "replicas": r,
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
            (d / ((r - 1) * sizes.stage_bytes(s)) for s, d in enumerate(stage_download)), default=None
        ),
        "anchor_download_bytes": per_peer("anchors", "down"),
        "anchor_upload_bytes": per_peer("anchors", "up"),
        "seal_s": timeline.finish_s["seal"],
        "round_s": timeline.makespan_s,
        "round_limit_s": limits[busiest],
        "busiest_link": f"{busiest[0]} {busiest[1]}",
        "control_scheme": "today" if mode == "hub" else "target",
        "control_bytes_per_peer": control.per_peer,
        "control_bytes_hot_peer": control.hot_peer,
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
    """The issue's targets, each as (value, limit, met) per config, from the any-holder rows."""
    by = {(r["config"], r["replicas"], r["mode"]): r for r in rows}
    out: dict[str, dict] = {}
    top = max(plan.replicas)
    for name, s in sizes.items():
        at64 = by.get((name, 64, "any-holder"))
        low, high = by.get((name, min(plan.replicas), "any-holder")), by.get((name, top, "any-holder"))
        checks = {}
        if at64:
            egress = at64["coordinator_egress_bytes"] / (2 * 64 * s.payload_bytes)
            checks["coordinator_egress_over_2Rp_at_64"] = {
                "value": egress,
                "limit": 1.0,
                "met": egress <= 1.0,
            }
            ratio = at64["round_s"] / at64["round_limit_s"]
            checks["round_over_limit_at_64"] = {"value": ratio, "limit": 1.5, "met": ratio <= 1.5}
        worst = max(
            (
                r["stage_download_over_slice"]
                for r in rows
                if r["config"] == name and r["mode"] == "any-holder" and r["chains"]
            ),
            default=None,
        )
        if worst is not None:
            checks["stage_download_over_slice"] = {"value": worst, "limit": 1.2, "met": worst <= 1.2}
        if low and high:
            growth = high["control_bytes_per_peer"] / low["control_bytes_per_peer"]
            allowed = math.log(high["peers"]) / math.log(low["peers"])
            checks["control_growth"] = {
                "value": growth,
                "limit": allowed,
                "met": growth <= allowed,
                "peers": [low["peers"], high["peers"]],
            }
        out[name] = checks
    return out


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
                "crossover_R_simulated": _simulated_crossover(rows, name),
            }
            for name, s in sizes.items()
        },
        "rows": rows,
        "targets": targets(rows, plan, sizes),
        "lab_check": lab_check(lab) if lab is not None else None,
    }
    (out_dir / "scale.json").write_text(json.dumps(report, indent=2))
    plot(report, out_dir / "scale.png")
    return report


def _simulated_crossover(rows: list[dict], name: str) -> int | None:
    """The first simulated R at which the tile-range aggregation's round is shorter than any-holder's."""
    times = {(r["replicas"], r["mode"]): r["round_s"] for r in rows if r["config"] == name}
    wins = [r for (r, mode), t in times.items() if mode == "tiles" and t < times.get((r, "any-holder"), -1.0)]
    return min(wins, default=None)


def plot(report: dict, path: Path) -> None:
    rows = report["rows"]
    configs = list(report["configs"])
    modes = sorted({r["mode"] for r in rows}, key=MODES.index)
    colors = dict(zip(configs, ("tab:blue", "tab:orange", "tab:green", "tab:red"), strict=False))
    styles = dict(zip(MODES, ("-", "--", ":"), strict=True))
    fig, axes = plt.subplots(2, 2, figsize=(13, 10))
    panels = (
        (axes[0][0], "coordinator_egress_bytes", "coordinator egress per round (bytes)"),
        (axes[0][1], "round_s", "sync time per round (s); thin: the busiest link's limit"),
        (axes[1][0], "stage_download_bytes", "largest stage's download per round (bytes; hub = any-holder)"),
    )
    for ax, key, title in panels:
        for name in configs:
            for mode in modes:
                pts = [(r["replicas"], r[key]) for r in rows if r["config"] == name and r["mode"] == mode]
                if not any(y > 0 for _, y in pts):  # a swarm without chains has no stage download
                    continue
                xs, ys = zip(*pts, strict=True)
                ax.plot(xs, ys, styles[mode], color=colors[name], marker="o", label=f"{name} {mode}")
                if key == "round_s":
                    limit = [r["round_limit_s"] for r in rows if r["config"] == name and r["mode"] == mode]
                    ax.plot(xs, limit, styles[mode], color=colors[name], linewidth=0.6)
        ax.set(xscale="log", yscale="log", xlabel="replicas R", title=title)
        ax.grid(True, which="both", alpha=0.3)
    for name in configs:  # the bound on any-holder's coordinator egress
        p = report["configs"][name]["payload_bytes"]
        xs = sorted({r["replicas"] for r in rows})
        axes[0][0].plot(xs, [2 * x * p for x in xs], color=colors[name], linewidth=0.6, alpha=0.6)
    axes[0][0].legend(fontsize=7, ncol=2, title="thin: 2·R·p", title_fontsize=7)
    ax = axes[1][1]
    for name in configs:
        for mode, scheme in (("hub", "today"), ("any-holder", "target")):
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
