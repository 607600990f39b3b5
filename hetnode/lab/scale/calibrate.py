"""`hetnode bench scale --calibrate`: the scale model next to real daemons in the netns lab (docs/scale.md).

The lab (`scale_lab.py`) runs a coordinator, anchors and chains on tc-shaped links and measures what a
sealed round costs. The model (`scale.simulate_round`, mode `any-holder`, the code's schedule) is then run
for the same swarm: the same mix of anchors and chains, the lab's link rates and measured RTT, the
config's real payload sizes, today's control plane at the lab's heartbeat and round length. Its CPU term
(`scale_cpu`) is measured here, on one thread, outside the lab: the sealer's check and aggregation before
the seal, then each core's share of applying it and of the hashing and local-state saving that follow
(the lab pins processes to cores). Both go side by side
into `calibration.json`; `comparison` says, per quantity, whether the model is within 25 %.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
from collections.abc import Mapping, Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

from hetnode.config import Config, replace
from hetnode.errors import HetnodeError
from hetnode.lab.guard import check_chain_possible, check_roles_possible
from hetnode.lab.netlab.hosts import check_lab_possible
from hetnode.lab.scale import control as scale_control
from hetnode.lab.scale.comparison import compare
from hetnode.lab.scale.cpu import RoundCpu, measure_round_cpu
from hetnode.lab.scale.dht import SealTrip, measure_seal_trip, measure_transport_cpu
from hetnode.lab.scale.lab_runs import CalibrationPlan, run_lab
from hetnode.lab.scale.model import ScalePlan, simulate_round
from hetnode.lab.scale.schedules import Links, Swarm
from hetnode.lab.scale.sizes import payload_sizes, seal_bytes, stage_shards
from hetnode.planning.layer_split import split_layers

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
    transport_s_per_byte: float | None = None,
) -> dict[str, Any]:
    """The scale model's any-holder row for the lab's swarm, links and round; with `stage_layers`
    ({daemon: [stage, first layer, last layer]}, from the lab) the chain's layers as the planner split them
    (by measured compute: not always evenly). `cpu`: the round's CPU costs, `seal_trip`: the seal's store
    and read in the DHT, `transport_s_per_byte`: moving payloads' CPU (each measured here when None).
    Beside the fair-sharing row, `drop_tail`: the same round with the stages' flows to the anchors starved
    until the anchors' exchange ends (`schedule`)."""
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
    if transport_s_per_byte is None:
        transport_s_per_byte = measure_transport_cpu(sizes.payload_bytes)
    moved = row["anchor_download_bytes"] + row["anchor_upload_bytes"]
    # the anchors share their cores; the chains' stages share theirs with the coordinator's own step
    anchors_per_core = -(-plan.anchors // cores_of(plan.anchor_cores))
    # (and each stage's hashing and saving: the last to finish applies before it saves, an error of one
    # stage's saving at most)
    stage_work_s = sum(cpu.stage_apply_s) + sum(cpu.stage_saving_s)
    stage_core_s = (plan.chains * stage_work_s + cpu.commit_s) / cores_of(plan.chain_cores)
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
        "anchor_apply_shared_s": cpu.anchors_applied_s(anchors_per_core),
        # each end's half of moving an anchor's sync bytes, on loopback: small beside its apply (not added)
        "transport_cpu_s_per_mb": transport_s_per_byte * 2**20,
        "anchor_transport_cpu_s": moved * transport_s_per_byte / 2,
    }


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
    transport_s_per_byte: float | None = None,
) -> dict[str, Any]:
    """The report from what the lab measured: the model run for it and the comparison (`cpu`, `seal_trip`,
    `transport_s_per_byte`: measured here when None)."""
    model = model_side(
        config,
        plan,
        measured["rtt_s"],
        measured["round_wall_s"],
        measured.get("stage_layers"),
        cpu,
        seal_trip,
        transport_s_per_byte,
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
