"""`hetnode bench scale --calibrate`: the scale model next to real daemons in the netns lab (docs/scale.md).

The lab (`scale_lab.py`) runs a coordinator, anchors and chains on tc-shaped links and measures what a
sealed round costs. The model (`scale.simulate_round`, mode `any-holder`, the code's schedule) is then run
for the same swarm: the same mix of anchors and chains, the lab's link rates and measured RTT, the
config's real payload sizes, today's control plane at the lab's heartbeat and round length. Its CPU term
(`scale_cpu`) is measured here, on one thread, outside the lab: the sealer's check and aggregation before
the seal, then each core's share of applying it (the lab pins processes to cores). Both go side by side
into `calibration.json`; `comparison` says, per quantity, whether the model is within 25 %.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

from hetnode.bench import scale_control
from hetnode.bench.lab_guard import check_chain_possible, check_roles_possible
from hetnode.bench.netlab import check_lab_possible
from hetnode.bench.scale import ScalePlan, simulate_round
from hetnode.bench.scale_cpu import RoundCpu, measure_round_cpu
from hetnode.bench.scale_dht import SealTrip, measure_seal_trip
from hetnode.bench.scale_lab import CalibrationPlan, run_lab
from hetnode.bench.scale_schedules import Links, Swarm
from hetnode.bench.scale_sizes import payload_sizes, seal_bytes, stage_shards
from hetnode.config import Config, replace
from hetnode.errors import HetnodeError
from hetnode.planning.layer_split import split_layers

TOLERANCE = 0.25
# One machine: the DHT answers in milliseconds (as in `hetnode bench network`); heartbeats stay seconds
# apart so that control traffic stays well below the 20 Mbit/s links
LAB_TIMINGS = {"heartbeat_s": 2.0, "record_ttl_s": 8.0, "boundary_s": 4.0, "confirm_s": 2.0}
COMMAND = "sudo .venv/bin/hetnode bench scale --calibrate --out benchmarks/results/scale"


def lab_config(config: Config, plan: CalibrationPlan) -> Config:
    """`config` as the lab runs it: short rounds of small batches (ten processes share the CPUs), chains
    of `plan.stages`, anchors admitted at the lab's anchor rate. The payloads keep the config's sizes."""
    # no verification: on batches of 2 its scores are noise that leaves honest replicas out of the seal,
    # which changes what is fetched; and it takes the coordinator's CPU from sealing
    config = replace(config, "outer", inner_steps=plan.inner_steps, verify=False)
    config = replace(config, "pipeline", stages=plan.stages)
    config = replace(config, "data", batch_size=plan.batch_size, seq_len=plan.seq_len)
    floor = min(plan.anchor_mbit, plan.coordinator_mbit) / 2
    # stages on links slower than the config's minimum (a link-bound calibration) are still stages
    stage_floor = min(config.network.stage_min_up_mbps, plan.stage_mbit / 2)
    return replace(
        config,
        "network",
        anchor_min_up_mbps=floor,
        anchor_min_down_mbps=floor,
        stage_min_up_mbps=stage_floor,
        **LAB_TIMINGS,
    )


def check_plan(config: Config, plan: CalibrationPlan) -> None:
    """Refuse a plan the lab cannot run (`config` as `lab_config` made it): links below a role's minimum,
    chains that cannot form, nothing to measure."""
    anchors, stages = plan.names()
    members = {a: ("anchor", plan.anchor_mbit) for a in anchors} | {
        s: ("stage", plan.stage_mbit) for s in stages
    }
    check_roles_possible(config, members, "CalibrationPlan.anchor_mbit/stage_mbit")
    if plan.chains:
        check_chain_possible(config, plan.stages, "CalibrationPlan.stages")
    if plan.replicas < 1 or plan.rounds < 1 or plan.warmup_rounds < 1:
        raise HetnodeError(f"the calibration needs a replica, a warm-up round and a measured round: {plan}")


def cores_of(cpu_list: str) -> int:
    """How many cores a taskset list names ("0", "1-3", "0,2")."""
    count = 0
    for part in cpu_list.split(","):
        first, _, last = part.partition("-")
        count += int(last or first) - int(first) + 1
    return count


def lab_splits(config: Config, stage_layers: Mapping[str, Sequence[int]] | None) -> list[range]:
    """A chain's layers per stage as the lab's planner split them, or the even split."""
    splits = {s: range(first, last + 1) for s, first, last in (stage_layers or {}).values()}
    if sorted(splits) == list(range(config.pipeline.stages)):
        return [splits[s] for s in range(config.pipeline.stages)]
    return split_layers(config.model.n_layers, [1.0] * config.pipeline.stages)


def model_side(
    config: Config,
    plan: CalibrationPlan,
    rtt_s: float,
    round_wall_s: float,
    stage_layers: Mapping[str, Sequence[int]] | None = None,
    cpu: RoundCpu | None = None,
    seal_trip: SealTrip | None = None,
) -> dict[str, Any]:
    """The scale model's any-holder row for the lab's swarm, links and round; with `stage_layers`
    ({daemon: [stage, first layer, last layer]}, from the lab) the chain's layers as the planner split them
    (by measured compute: not always evenly). `cpu`: the round's CPU costs, `seal_trip`: the seal's store
    and read in the DHT (each measured here when None). Beside the fair-sharing row, `drop_tail`: the same
    round with the stages' flows to the anchors starved until the anchors' exchange ends (`schedule`)."""
    sizes = payload_sizes(config)
    splits = lab_splits(config, stage_layers)
    if stage_layers:
        held = stage_shards(splits, config.model.tie_embeddings)
        sizes = dataclasses.replace(sizes, stage_shards=held)
    swarm = Swarm(plan.anchors, plan.chains, plan.stages)
    links = Links(plan.anchor_mbit, plan.stage_mbit, plan.coordinator_mbit, rtt_s)
    control = scale_control.ControlModel(round_period_s=round_wall_s, heartbeat_s=config.network.heartbeat_s)
    scale_plan = ScalePlan((swarm.replicas,), (config.run.name,), links=links, control=control)
    row = simulate_round("any-holder", sizes, swarm, scale_plan)
    starved = simulate_round("any-holder", sizes, swarm, dataclasses.replace(scale_plan, drop_tail=True))
    seal = seal_bytes(sizes, swarm.anchors, swarm.chains)
    cpu = cpu or measure_round_cpu(config, plan.anchors, plan.chains, splits)
    seal_trip = seal_trip or measure_seal_trip(seal)
    # the anchors share their cores; the chains' stages share theirs with the coordinator's own step
    anchors_per_core = -(-plan.anchors // cores_of(plan.anchor_cores))
    stage_core_s = (plan.chains * sum(cpu.stage_apply_s) + cpu.commit_s) / cores_of(plan.chain_cores)
    before_seal_s, after_fetch_s = cpu.critical_path_s(anchors_per_core, stage_core_s)
    return {
        "row": row,
        "payload_bytes": sizes.payload_bytes,
        "stage_payload_bytes": [sizes.stage_bytes(s) for s in range(plan.stages)],
        "stage_shards": sizes.stage_shards,
        "seal_bytes": seal,
        "links": asdict(links),
        "cpu": asdict(cpu),
        "drop_tail": {key: starved[key] for key in ("round_s", "seal_s", "fetch_s")},
        "seal_trip": asdict(seal_trip),
        # the sealer's check and aggregation, then the seal's store and read: before the first fetch
        "cpu_before_seal_s": before_seal_s + seal_trip.total_s,
        "cpu_after_fetch_s": after_fetch_s,
        "anchor_apply_shared_s": anchors_per_core * cpu.anchor_apply_s,
    }


def compare(measured: dict[str, Any], model: dict[str, Any], plan: CalibrationPlan) -> list[dict[str, Any]]:
    """Model against lab, per quantity and round. `lab` is what the lab measured (medians over the
    measured rounds; counters: change over the window ÷ rounds); `within` when |model/lab − 1| ≤ 25 %."""
    row, hosts, logs = model["row"], measured["hosts"], measured["logs"]
    anchors, stages = plan.names()
    seal = model["seal_bytes"]
    # which daemon is which stage: the planner numbers them, not their names (the names' order otherwise)
    layers = measured.get("stage_layers") or {}
    at_stage = {
        s: [n for n in stages if layers.get(n, [None])[0] == s] or stages[s :: plan.stages]
        for s in range(plan.stages)
    }

    def median_of(names: list[str], get: Any) -> float | None:
        values = sorted(v for v in (get(n) for n in names) if v is not None)
        return values[len(values) // 2] if values else None

    out: list[dict[str, Any]] = []

    def add(quantity: str, unit: str, modelled: float, lab: float | None, note: str = "") -> None:
        ratio = modelled / lab if lab else None
        within = ratio is not None and abs(ratio - 1) <= TOLERANCE
        if not lab and not modelled:  # both nothing: the model says what the lab shows
            within, ratio = True, None
        out.append(
            {"quantity": quantity, "unit": unit, "model": modelled, "lab": lab, "model_over_lab": ratio}
            | {"within_25pct": within, "note": note}
        )

    add(
        "payload p (an anchor's upload)",
        "bytes",
        model["payload_bytes"],
        median_of(anchors, lambda n: logs[n]["upload_bytes"]),
    )
    for s in range(plan.stages):
        names = at_stage[s]
        add(
            f"stage {s} slice",
            "bytes",
            model["stage_payload_bytes"][s],
            median_of(names, lambda n: logs[n]["upload_bytes"]),
        )
    add(
        "coordinator sync ingress (validation)",
        "bytes/round",
        row["coordinator_ingress_bytes"],
        hosts["coordinator"]["sync_received"],
    )
    add(
        "coordinator sync egress (fallback)",
        "bytes/round",
        row["daemon"]["fallback_bytes"],
        hosts["coordinator"]["sync_sent"],
        "no fallback in a fault-free round; seals go through the DHT, not the sync channel",
    )
    add(
        "coordinator wire egress",
        "bytes/round",
        row["coordinator_egress_bytes"],
        hosts["coordinator"]["tx"],
        "the model counts seals only; the wire carries the DHT (the coordinator is the bootstrap node)",
    )
    add(
        "coordinator wire ingress",
        "bytes/round",
        row["coordinator_ingress_bytes"],
        hosts["coordinator"]["rx"],
        "payloads + DHT",
    )
    add(
        "anchor sealed download (payloads)",
        "bytes/round",
        row["anchor_download_bytes"] - seal,
        median_of(anchors, lambda n: logs[n]["download_bytes"]),
    )
    add(
        "anchor sync upload (served)",
        "bytes/round",
        row["anchor_upload_bytes"],
        median_of(anchors, lambda n: hosts[n]["sync_sent"]),
    )
    for s in range(plan.stages):
        names = at_stage[s]
        add(
            f"stage {s} sealed download (payloads)",
            "bytes/round",
            row["stage_download_bytes_by_stage"][s] - seal,
            median_of(names, lambda n: logs[n]["download_bytes"]),
        )
        add(
            f"stage {s} sync upload (served)",
            "bytes/round",
            plan.replicas * model["stage_payload_bytes"][s],
            median_of(names, lambda n: hosts[n]["sync_sent"]),
        )
    add(
        "anchor fetch time",
        "s",
        row["fetch_s"]["anchors"],
        median_of(anchors, lambda n: logs[n]["fetch_s"]),
        "seal → fetched",
    )
    for s in range(plan.stages):
        names = at_stage[s]
        add(
            f"stage {s} fetch time",
            "s",
            row["fetch_s"][f"stage{s}"],
            median_of(names, lambda n: logs[n]["fetch_s"]),
            "seal → fetched",
        )
    fetched_s = row["round_s"] + model["cpu_before_seal_s"]
    add(
        "anchor checking and applying (fetched → applied)",
        "s",
        model["anchor_apply_shared_s"],
        median_of(anchors, lambda n: _apply_after_fetch(logs[n])),
        "decode, aggregate and step, each anchor's share of their core",
    )
    add(
        "sync time (last announcement → all fetched)",
        "s",
        fetched_s,
        measured.get("critical_fetch_s"),
        "links (validation, seal, fetching) plus the sealer's check and aggregation",
    )
    add(
        "sync time (last announcement → all applied)",
        "s",
        fetched_s + model["cpu_after_fetch_s"],
        measured["critical_sync_s"],
        "then the busiest core's share of applying the seal",
    )
    starved = model["drop_tail"]
    add(
        "sync time, drop-tail model (last announcement → all fetched)",
        "s",
        starved["round_s"] + model["cpu_before_seal_s"],
        measured.get("critical_fetch_s"),
        "the stages' flows to the anchors start when the anchors' exchange has emptied their downlinks",
    )
    add(
        "sync time, drop-tail model (last announcement → all applied)",
        "s",
        starved["round_s"] + model["cpu_before_seal_s"] + model["cpu_after_fetch_s"],
        measured["critical_sync_s"],
    )
    windows = list((measured.get("links") or {}).get("windows", {}).values())
    if windows:
        add(
            "sealing (trace: last announcement → first replica holds the seal)",
            "s",
            row["seal_s"] + model["cpu_before_seal_s"],
            statistics.median(w["sealed"] - w["announced"] for w in windows),
            "validation downloads, the sealer's check and aggregation, the seal's store and read",
        )
        lab_fetching = statistics.median(w["fetched"] - w["sealed"] for w in windows)
        add(
            "fetching (trace: first seal held → last replica fetched)",
            "s",
            row["round_s"] - row["seal_s"],
            lab_fetching,
            "fair sharing of every link",
        )
        add(
            "fetching, drop-tail model (trace)",
            "s",
            starved["round_s"] - starved["seal_s"],
            lab_fetching,
            "the stages' flows wait for the anchors' exchange",
        )
    sync = row["anchor_download_bytes"] + row["anchor_upload_bytes"]
    wire = median_of(anchors, lambda n: hosts[n]["rx"] + hosts[n]["tx"])
    add(
        "anchor wire bytes (in + out)",
        "bytes/round",
        sync + row["control_bytes_per_peer"],
        wire,
        "sync + the code's control model (vouched), a peer's average (at the lab's heartbeat and round)",
    )
    add(
        "anchor wire bytes, model's hot peer",
        "bytes/round",
        sync + row["control_bytes_hot_peer"],
        wire,
        "sync + the control of a replica node of the `peers` key (an anchor may be one)",
    )
    return out


def _apply_after_fetch(log: Mapping[str, Any]) -> float | None:
    apply_s, fetch_s = log.get("apply_s"), log.get("fetch_s")
    return apply_s - fetch_s if apply_s is not None and fetch_s is not None else None


def run_calibration(
    config: Config, out_dir: Path, plan: CalibrationPlan | None = None, progress: bool = True
) -> dict:
    """Lab, then model, then `out_dir/calibration.json`."""
    plan = plan or CalibrationPlan()
    config = lab_config(config, plan)
    check_plan(config, plan)
    check_lab_possible()
    out_dir.mkdir(parents=True, exist_ok=True)
    # scratch (identities, checkpoints, logs: gigabytes) where git ignores it, as `bench network` does
    work = out_dir / "network-lab" / "calibration"
    measured = run_lab(config, plan, work, progress)
    if (work / "link-trace.png").exists():
        shutil.copy(work / "link-trace.png", out_dir / "link-trace.png")
    report = calibration_report(config, plan, measured)
    report["command"] = command_for(plan, out_dir)
    (out_dir / "calibration.json").write_text(json.dumps(report, indent=2))
    return report


def remodel(config: Config, out_dir: Path) -> dict:
    """The model run again for the lab measurement `out_dir/calibration.json` holds (a changed model, the
    same lab run), rewriting that file; its `command` still names the lab run, `remodelled` this one."""
    path = out_dir / "calibration.json"
    if not path.exists():
        raise HetnodeError(f"{path} does not exist: run the calibration with the lab first")
    earlier = json.loads(path.read_text())
    plan = CalibrationPlan(**earlier["plan"])
    report = calibration_report(lab_config(config, plan), plan, earlier["measured"])
    report["command"] = earlier.get("command", command_for(plan, out_dir))
    report["remodelled"] = f"{command_for(plan, out_dir)} --remodel"
    path.write_text(json.dumps(report, indent=2))
    return report


def command_for(plan: CalibrationPlan, out_dir: Path) -> str:
    """The command line that runs this calibration again."""
    rates = (
        ""
        if (plan.anchor_mbit, plan.stage_mbit) == (100.0, 20.0)
        else (f" --lab-mbit {plan.anchor_mbit:g} {plan.stage_mbit:g}")
    )
    return f"sudo .venv/bin/hetnode bench scale --calibrate{rates} --out {out_dir}"


def calibration_report(
    config: Config,
    plan: CalibrationPlan,
    measured: dict[str, Any],
    cpu: RoundCpu | None = None,
    seal_trip: SealTrip | None = None,
) -> dict[str, Any]:
    """The report from what the lab measured: the model run for it and the comparison."""
    model = model_side(
        config,
        plan,
        measured["rtt_s"],
        measured["round_wall_s"],
        measured.get("stage_layers"),
        cpu,
        seal_trip,
    )
    comparison = compare(measured, model, plan)
    return {
        "command": COMMAND,
        "config": config.run.name,
        "plan": asdict(plan),
        "lab_config": {k: getattr(config.network, k) for k in LAB_TIMINGS}
        | {
            "inner_steps": config.outer.inner_steps,
            "batch_size": config.data.batch_size,
            "seq_len": config.data.seq_len,
        },
        "measured": measured,
        "model": model,
        "comparison": comparison,
        "within_25pct": [c["quantity"] for c in comparison if c["within_25pct"]],
        "outside_25pct": [c["quantity"] for c in comparison if not c["within_25pct"]],
    }
