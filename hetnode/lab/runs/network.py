"""`hetnode bench network`: the real daemons in a network lab (issue 6 targets; docs/sync.md, "Rounds over
the network").

One run, side by side on the same shaped links (`netlab.py`): a coordinator, two anchors on unshaped links
and one chain of two stages on `slow_mbit` links each.
1. The swarm with subspace-compressed chain boundaries (`pipeline.compression = "selective"`).
2. The same swarm with uncompressed boundaries (`"none"`): chain tokens/s with vs without compression.
3. hivemind's own dense all-reduce (`DecentralizedAverager`, fp16) of a model-sized vector among the four
   replica hosts: bytes and seconds per round against one SparseLoCo round.
4. `hetnode train`'s inner loop on the same config, alone on the machine, against an anchor's tokens/s
   between rounds: in the full swarm (five trainers share the machine's cores) and with the coordinator and
   one anchor alone (the daemon's own overhead, as on a volunteer's machine of its own).

Daemons write what each round cost (`DATA_DIR/rounds-local.jsonl`); interface byte counters of every host
give the bytes on the wire, DHT traffic included. Results: `network.json` and `network.png`.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import matplotlib
import torch

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from hetnode.config import Config, dump_config, replace  # noqa: E402
from hetnode.data import TokenDataset  # noqa: E402
from hetnode.errors import HetnodeError  # noqa: E402
from hetnode.lab.guard import (  # noqa: E402
    STALL_ROUNDS,
    LabStalled,
    check_chain_possible,
    check_roles_possible,
    check_running,
    interruptible,
    lab_session,
    shielded,
    stalled_reason,
)
from hetnode.lab.netlab.hosts import NetLab, check_lab_possible  # noqa: E402
from hetnode.lab.procs import LabProcess, stop_all  # noqa: E402
from hetnode.lab.swarm import Member, merged_history, read_jsonl, running_swarm  # noqa: E402
from hetnode.model import build_model, count_parameters  # noqa: E402
from hetnode.training.trainer import InnerTrainer  # noqa: E402

log = logging.getLogger(__name__)

ROUND_LOG = "rounds-local.jsonl"  # written by every daemon (hetnode/service/round_log.py)
HISTORY = "rounds.jsonl"  # the coordinator's sealed rounds
ANCHORS = ("anchor-1", "anchor-2")
STAGES = ("stage-1", "stage-2")
# One machine: the DHT answers in milliseconds, so boundaries can be short; heartbeats stay a few seconds
# apart so that the control plane's bytes (records, polls) stay small next to a round's payloads.
# the daemon-overhead run: the anchor on core 0 (as `hetnode train` is measured), the coordinator on core 1,
# as on two machines: its evaluation after each round then takes nothing from the anchor's training
SOLO_CORES = {"anchor-1": "0", "coordinator": "1"}
LAB_TIMINGS = {"heartbeat_s": 2.0, "record_ttl_s": 8.0, "boundary_s": 4.0, "confirm_s": 2.0}
ANCHOR_MBIT = 1000.0  # what the anchors declare (their links are not shaped)
STOP_GRACE_S = 5.0  # for the daemons to exit on SIGTERM before they are killed


@dataclass(frozen=True)
class NetworkPlan:
    inner_steps: int  # H
    chain_rounds: int  # sealed rounds with the chain in them, per swarm run
    allreduce_rounds: int
    slow_mbit: float = 20.0
    timeout_s: float = 900.0  # per swarm run


def plan_for(quick: bool) -> NetworkPlan:
    if quick:
        return NetworkPlan(inner_steps=10, chain_rounds=3, allreduce_rounds=3, timeout_s=420.0)
    return NetworkPlan(inner_steps=30, chain_rounds=6, allreduce_rounds=5, timeout_s=1800.0)


def check_plan(config: Config, plan: NetworkPlan) -> None:
    """Refuse a plan whose chain cannot form (ConfigError naming the flag and the config key)."""
    members = {a: ("anchor", ANCHOR_MBIT) for a in ANCHORS} | {s: ("stage", plan.slow_mbit) for s in STAGES}
    check_roles_possible(config, members, "--slow-mbit")
    check_chain_possible(config, len(STAGES), "bench network")
    if plan.chain_rounds < 1 or plan.allreduce_rounds < 1:
        raise HetnodeError(f"the plan needs at least one round of each kind: {plan}")


def run_benchmark(config: Config, plan: NetworkPlan, out_dir: Path, progress: bool = True) -> dict:
    check_plan(replace(config, "pipeline", stages=len(STAGES)), plan)  # before root: a plan is a plan
    check_lab_possible()
    out_dir.mkdir(parents=True, exist_ok=True)
    work = out_dir / "network-lab"
    shutil.rmtree(work, ignore_errors=True)  # a fresh swarm: no identities, checkpoints or logs from before
    work.mkdir()
    config = replace(config, "outer", inner_steps=plan.inner_steps)
    config = replace(config, "pipeline", stages=2)
    config = replace(config, "network", **LAB_TIMINGS)
    with interruptible():  # SIGTERM unwinds as Ctrl+C does: every lab below is stopped and removed
        return _run_benchmark(config, plan, out_dir, work, progress)


def _run_benchmark(config: Config, plan: NetworkPlan, out_dir: Path, work: Path, progress: bool) -> dict:
    _say(progress, f"local baseline: {plan.inner_steps} inner steps of hetnode train's loop, alone")
    local_tokens_per_s = measure_local_tokens_per_s(config, plan.inner_steps)
    runs = {}
    for anchors in (2, 0):
        for mode in ("selective", "none"):
            name = mode if anchors else f"chain-only-{mode}"
            what = "coordinator, 2 anchors and a chain" if anchors else "coordinator and the chain alone"
            _say(progress, f"{what}; chain compression {mode!r} on {plan.slow_mbit:g} Mbit/s links")
            mode_config = replace(config, "pipeline", compression=mode)
            runs[name] = run_swarm(mode_config, plan, work / name, progress, anchors=ANCHORS[:anchors])
    _say(
        progress, "coordinator and one anchor alone, each on a core of its own, against hetnode train on one"
    )
    solo_config = replace(config, "pipeline", compression="selective")
    runs["anchor-alone"] = run_swarm(
        solo_config, plan, work / "anchor-alone", progress, ANCHORS[:1], (), pin=SOLO_CORES
    )
    local_one_core = measure_local_tokens_per_s(config, plan.inner_steps, cores={0})
    _say(progress, "hivemind DecentralizedAverager (fp16) over the same links")
    allreduce = run_allreduce(config, plan, work / "allreduce")
    report = summarise(config, plan, runs, allreduce, local_tokens_per_s, local_one_core)
    (out_dir / "network.json").write_text(json.dumps(report, indent=2))
    plot_network(report, out_dir / "network.png")
    return report


def _say(progress: bool, text: str) -> None:
    if progress:
        print(f"[bench network] {text}", flush=True)


# --- the pieces ---------------------------------------------------------------------------------------


def measure_local_tokens_per_s(config: Config, steps: int, cores: set[int] | None = None) -> float:
    """tokens/s of the local trainer's inner loop (a short warm-up, then 3 x `steps` timed steps), on
    `cores` only when given (the process's CPU affinity is restored afterwards)."""
    if cores is not None:  # one torch thread per core: more threads than cores spin against each other
        before, threads = os.sched_getaffinity(0), torch.get_num_threads()
        os.sched_setaffinity(0, cores)
        torch.set_num_threads(len(cores))
        try:
            return measure_local_tokens_per_s(config, steps)
        finally:
            os.sched_setaffinity(0, before)
            torch.set_num_threads(threads)
    dataset = TokenDataset.build(config.data, config.model.vocab_size, config.run.seed)
    trainer = InnerTrainer(config, build_model(config.model, seed=config.run.seed), dataset)
    for _ in range(max(2, steps // 3)):
        trainer.train_step()
    tokens, started = trainer.tokens, time.perf_counter()
    for _ in range(3 * steps):  # three rounds' worth: a short window is noisy on a shared machine
        trainer.train_step()
    return (trainer.tokens - tokens) / (time.perf_counter() - started)


def _pinned(name: str, pin: dict[str, str] | None) -> list[str]:
    """Pin a process to one core (`taskset`) with one torch thread; nothing for a process not in `pin`."""
    return ["env", "OMP_NUM_THREADS=1", "taskset", "-c", pin[name]] if pin and name in pin else []


def lab_rates(
    plan: NetworkPlan, anchors: tuple[str, ...] = ANCHORS, stages: tuple[str, ...] = STAGES
) -> dict[str, float | None]:
    return {"coordinator": None, **{a: None for a in anchors}, **{s: plan.slow_mbit for s in stages}}


def run_swarm(
    config: Config,
    plan: NetworkPlan,
    work: Path,
    progress: bool,
    anchors: tuple[str, ...] = ANCHORS,
    stages: tuple[str, ...] = STAGES,
    pin: dict[str, str] | None = None,
) -> dict[str, Any]:
    """Coordinator + `anchors` + a chain of `stages` in the lab until `chain_rounds` rounds included the
    chain (without a chain: the first anchor).

    Without anchors the chain has the machine's CPUs to itself: its tokens/s then show what the link
    costs, not what sharing two cores with four other trainers costs."""
    work.mkdir(parents=True, exist_ok=True)
    config_path = work / "swarm.toml"
    config_path.write_text(dump_config(config))
    members = [Member(a, "anchor", ANCHOR_MBIT) for a in anchors]
    members += [Member(s, "stage", plan.slow_mbit) for s in stages]
    links = lab_rates(plan, anchors, stages)
    say = lambda text: _say(progress, text)  # noqa: E731 - a local shorthand
    with running_swarm(config_path, work, links, members, say, lambda name: _pinned(name, pin)) as swarm:
        lab, processes, ids = swarm.lab, swarm.processes, swarm.ids
        wire_before = {name: lab.interface_bytes(name) for name in lab.hosts}
        watched = {ids[s] for s in stages} if stages else {ids[anchors[0]]}
        history = _wait_for_rounds(work / "coordinator", watched, plan, progress, processes)
        wire_after = {name: lab.interface_bytes(name) for name in lab.hosts}
    wire = {
        name: {
            "rx": wire_after[name][0] - wire_before[name][0],
            "tx": wire_after[name][1] - wire_before[name][1],
        }
        for name in wire_before
    }
    return {
        "peer_ids": ids,
        "history": history,
        "round_logs": {name: read_jsonl(work / name / ROUND_LOG) for name in (*anchors, *stages)},
        "wire_bytes": wire,
    }


def _wait_for_rounds(
    coordinator_dir: Path,
    chain: set[str],
    plan: NetworkPlan,
    progress: bool,
    processes: list[LabProcess] | None = None,
) -> list[dict]:
    """The coordinator's history once `chain` (the peers watched) was in `plan.chain_rounds` seals. Ends
    with the reason (who took which role, who exited) when a daemon exits, when STALL_ROUNDS sealed rounds
    in a row went without the watched peers, or at `plan.timeout_s`."""
    processes = processes or []
    deadline = time.monotonic() + plan.timeout_s
    shown = 0
    while time.monotonic() < deadline:
        check_running(processes)
        history = merged_history(read_jsonl(coordinator_dir / HISTORY))
        for entry in history[shown:]:
            if progress:  # the eval loss comes later, beside the next seals: shown when it is there
                mark = "with the watched peers" if chain <= set(entry["contributors"]) else "without them"
                loss = entry.get("eval_loss")
                print(
                    f"  round {entry['round']:>3}  {len(entry['contributors'])} contributions ({mark})"
                    + (f"  eval loss {loss:.3f}" if loss is not None else ""),
                    flush=True,
                )
        shown = len(history)
        if sum(chain <= set(e["contributors"]) for e in history) >= plan.chain_rounds:
            return history
        if rounds_without(history, chain) >= STALL_ROUNDS:
            raise LabStalled(
                f"{STALL_ROUNDS} sealed rounds in a row without the watched peers; the daemons' roles:\n"
                + stalled_reason(processes, {p.name: p.log_path for p in processes[1:]})
            )
        time.sleep(1.0)
    raise LabStalled(
        f"the watched peers were not in {plan.chain_rounds} sealed rounds within {plan.timeout_s:.0f} s; "
        "the daemons' roles:\n" + stalled_reason(processes, {p.name: p.log_path for p in processes[1:]})
    )


def rounds_without(history: list[dict], watched: set[str]) -> int:
    """Sealed rounds since the last one with every `watched` peer in it (all of them if none had)."""
    count = 0
    for entry in reversed(history):
        if watched <= set(entry["contributors"]):
            break
        count += 1
    return count


def run_allreduce(config: Config, plan: NetworkPlan, work: Path) -> dict[str, Any]:
    """hivemind's fp16 all-reduce of a model-sized vector among the four replica hosts of the lab."""
    work.mkdir(parents=True, exist_ok=True)
    numel = count_parameters(config.model)
    names = (*ANCHORS, *STAGES)
    processes: list[LabProcess] = []
    with lab_session(NetLab(lab_rates(plan))) as lab:
        try:
            for index, name in enumerate(names):
                host = lab.hosts[name]
                argv = [
                    sys.executable,
                    "-m",
                    "hetnode.lab.netbench.allreduce_baseline",
                    "--listen",
                    host.address,
                ]
                argv += ["--group-size", str(len(names)), "--numel", str(numel)]
                argv += ["--rounds", str(plan.allreduce_rounds), "--interface", host.device]
                argv += [
                    "--index",
                    str(index),
                    "--count",
                    str(len(names)),
                    "--out",
                    str(work / f"{name}.json"),
                ]
                if processes:
                    argv += ["--initial-peer", processes[0].maddr]
                processes.append(LabProcess(name, argv, work / f"{name}.log", host.prefix, detach=True))
                processes[-1].wait_ready()
            for process in processes:
                process.proc.wait(timeout=plan.timeout_s)
            failed = [p.name for p in processes if p.proc.returncode != 0]
            unusable = [name for name in failed if not ok_allreduce_rounds(work / f"{name}.json")]
            if unusable:
                tails = "\n".join(f"--- {p.name}\n{p.tail()}" for p in processes if p.name in unusable)
                raise HetnodeError(f"the all-reduce baseline failed on {unusable}:\n{tails}")
            if failed:  # some rounds came back wrong: timed from the good ones, reported as not all ok
                log.warning("all-reduce baseline: failed rounds on %s; timing the good rounds only", failed)
        except subprocess.TimeoutExpired:
            raise HetnodeError(f"the all-reduce baseline did not finish in {plan.timeout_s:.0f} s") from None
        finally:
            with shielded():
                stop_all(processes, STOP_GRACE_S)
    return {
        "numel": numel,
        "peers": {name: json.loads((work / f"{name}.json").read_text()) for name in names},
    }


def ok_allreduce_rounds(path: Path) -> list[dict]:
    """The rounds a baseline peer reported as correct (none if it wrote no result)."""
    try:
        return [r for r in json.loads(path.read_text())["rounds"] if r.get("ok")]
    except (OSError, ValueError, KeyError, TypeError):
        return []


# --- the report -------------------------------------------------------------------------------------


def _median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def critical_sync_s(logs: dict[str, list[dict]]) -> list[float]:
    """Per stage and round: from the round's last announcement (of any replica in the seal) to this stage
    having applied the round: what the sync adds to a round once every replica is ready. Waiting for a
    slower replica's training (part of `seal_wait_s`) is left out. Uses each record's `time` (made just
    before announcing)."""
    announced: dict[int, float] = {}
    for records in logs.values():
        for r in records:
            if r["included"] and "time" in r:
                announced[r["round"]] = max(announced.get(r["round"], 0.0), r["time"])
    return [
        r["time"] + r["seal_wait_s"] + r["apply_s"] - announced[r["round"]]
        for s in STAGES
        for r in logs.get(s, [])
        if r["included"] and "time" in r
    ]


def stage_times(rounds: list[dict[str, Any]], rate_bytes_per_s: float) -> dict[str, float | None]:
    """A stage's median seconds per micro-batch: in its forward/backward passes, writing frames to its
    neighbours, and what its frames need at the link rate alone (bytes sent / rate): link-bound when the
    link time exceeds the compute time."""
    timed = [r for r in rounds if r.get("compute_s") is not None and r.get("steps")]
    return {
        "compute_s": _median([r["compute_s"] / r["steps"] for r in timed]),
        "send_s": _median([r["send_s"] / r["steps"] for r in timed]),
        "link_s": _median([r["activation_bytes_sent"] / rate_bytes_per_s / r["steps"] for r in timed]),
    }


def summarise_swarm(run: dict[str, Any], plan: NetworkPlan) -> dict[str, Any]:
    """Per swarm run: the chain's tokens/s, and what a sync round cost an anchor and a slow stage."""
    logs, history = run["round_logs"], run["history"]
    rate_bytes_per_s = plan.slow_mbit * 1e6 / 8
    chain_rounds = sorted(
        set.intersection(*({r["round"] for r in logs[s]} for s in STAGES))
        if all(logs[s] for s in STAGES)
        else []
    )
    by_round = {s: {r["round"]: r for r in logs[s]} for s in STAGES}
    chain_tokens_per_s = [
        by_round[STAGES[0]][n]["tokens"] / max(by_round[s][n]["train_s"] for s in STAGES)
        for n in chain_rounds
    ]
    stage_sync = [r for s in STAGES for r in logs[s] if r["included"]]
    limits = [(r["upload_bytes"] + r["download_bytes"]) / rate_bytes_per_s for r in stage_sync]
    sync_s = [r["seal_wait_s"] + r["apply_s"] for r in stage_sync]
    critical = critical_sync_s(logs)
    limit = _median(limits)
    apply_limits = [r["download_bytes"] / rate_bytes_per_s for r in stage_sync]
    anchor_logs = [r for a in ANCHORS for r in logs.get(a, [])]
    seal_times = [e["time"] for e in history]
    rounds = max(1, len(history))
    return {
        "sealed_rounds": len(history),
        "rounds_with_chain": sum(
            set(run["peer_ids"][s] for s in STAGES) <= set(e["contributors"]) for e in history
        ),
        "round_wall_s": _median([b - a for a, b in zip(seal_times, seal_times[1:], strict=False)]),
        "chain_tokens_per_s": _median(chain_tokens_per_s),
        "activation_bytes_per_round": _median([r["activation_bytes_sent"] for r in logs[STAGES[0]]]),
        "per_micro_batch": {s: stage_times(logs[s], rate_bytes_per_s) for s in STAGES},
        "stage_sync": {
            "upload_bytes": _median([r["upload_bytes"] for r in stage_sync]),
            "download_bytes": _median([r["download_bytes"] for r in stage_sync]),
            "sync_s": _median(sync_s),
            "apply_s": _median([r["apply_s"] for r in stage_sync]),
            "fetch_s": _median([r.get("fetch_s", 0.0) for r in stage_sync]),
            "physical_limit_s": _median(limits),
            "sync_over_limit": _median([s / lim for s, lim in zip(sync_s, limits, strict=True) if lim > 0]),
            "critical_sync_s": _median(critical),
            "critical_over_limit": _ratio(_median(critical), limit),
            "apply_over_limit": _median(
                [r["apply_s"] / lim for r, lim in zip(stage_sync, apply_limits, strict=True) if lim > 0]
            ),
        },
        "anchor": {
            "tokens_per_s": _median([r["tokens_per_s"] for r in anchor_logs]),
            "upload_bytes": _median([r["upload_bytes"] for r in anchor_logs]),
            "download_bytes": _median([r["download_bytes"] for r in anchor_logs]),
            "sync_s": _median([r["seal_wait_s"] + r["apply_s"] for r in anchor_logs]),
        },
        "wire_bytes_per_round": {
            name: (counts["rx"] + counts["tx"]) / rounds for name, counts in run["wire_bytes"].items()
        },
        "eval_loss": [e["eval_loss"] for e in history],
    }


def summarise(
    config: Config,
    plan: NetworkPlan,
    runs: dict[str, dict[str, Any]],
    allreduce: dict[str, Any],
    local_tokens_per_s: float,
    local_one_core_tokens_per_s: float | None = None,
) -> dict[str, Any]:
    solo = runs["anchor-alone"]["round_logs"][ANCHORS[0]]
    solo_tokens_per_s = _median([r["tokens_per_s"] for r in solo])
    swarms = {mode: summarise_swarm(run, plan) for mode, run in runs.items() if mode != "anchor-alone"}
    peers = allreduce["peers"]
    slow = [r for s in STAGES for r in peers[s]["rounds"] if r["ok"]]  # a wrong result is no timing
    allreduce_summary = {
        "numel": allreduce["numel"],
        "seconds": _median([r["seconds"] for r in slow]),
        "wire_bytes_slow_peer": _median([(r["tx_bytes"] or 0) + (r["rx_bytes"] or 0) for r in slow]),
        "theory_bytes_per_peer": peers[STAGES[0]]["theory_bytes_per_peer"],
        "all_ok": all(r["ok"] for p in peers.values() for r in p["rounds"]),
        "ok_rounds_slow_peers": len(slow),
        # attempts the peers agreed to repeat (hivemind stalled or came back off the mean); all peers agree
        "repeated_attempts": sum(len(r.get("failed_attempts", [])) for r in peers[STAGES[0]]["rounds"]),
    }
    compressed, plain = swarms["selective"], swarms["none"]
    alone, alone_plain = swarms["chain-only-selective"], swarms["chain-only-none"]
    sync = compressed["stage_sync"]
    sparse_bytes = (sync["upload_bytes"] or 0) + (sync["download_bytes"] or 0)
    return {
        "config": {
            "run": config.run.name,
            "parameters": count_parameters(config.model),
            "H": plan.inner_steps,
        },
        "plan": asdict(plan),
        "local_tokens_per_s": local_tokens_per_s,
        "anchor_alone_tokens_per_s": solo_tokens_per_s,
        "local_one_core_tokens_per_s": local_one_core_tokens_per_s,
        "swarms": swarms,
        "allreduce_fp16": allreduce_summary,
        "targets": {
            "round_time_over_physical_limit": sync["critical_over_limit"],
            "announce_to_applied_over_physical_limit": sync["sync_over_limit"],
            "allreduce_bytes_over_sparseloco": _ratio(
                allreduce_summary["wire_bytes_slow_peer"], sparse_bytes
            ),
            "allreduce_seconds_over_sparseloco": _ratio(
                allreduce_summary["seconds"], sync["critical_sync_s"]
            ),
            "compressed_chain_speedup": _ratio(compressed["chain_tokens_per_s"], plain["chain_tokens_per_s"]),
            "compressed_chain_speedup_alone": _ratio(
                alone["chain_tokens_per_s"], alone_plain["chain_tokens_per_s"]
            ),
            "anchor_over_local_tokens_per_s": _ratio(
                compressed["anchor"]["tokens_per_s"], local_tokens_per_s
            ),
            "anchor_alone_over_local_tokens_per_s": _ratio(solo_tokens_per_s, local_one_core_tokens_per_s),
        },
    }


def plot_network(report: dict[str, Any], path: Path) -> None:
    swarm = report["swarms"]["selective"]
    allreduce = report["allreduce_fp16"]
    sync = swarm["stage_sync"]
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.5))
    labels = ["SparseLoCo\n(stage, app bytes)", "all-reduce fp16\n(slow peer, wire)"]
    sparse_bytes = (sync["upload_bytes"] or 0) + (sync["download_bytes"] or 0)
    axes[0].bar(
        labels, [sparse_bytes, allreduce["wire_bytes_slow_peer"] or 0], color=["tab:green", "tab:red"]
    )
    axes[0].set_yscale("log")
    axes[0].set_title("bytes per peer per sync round")
    axes[1].bar(
        [
            "SparseLoCo round\n(last announce\n→ applied)",
            "announce\n→ applied",
            "physical limit\n(bytes ÷ link)",
            "all-reduce\nfp16",
        ],
        [
            sync.get("critical_sync_s") or 0,
            sync["sync_s"] or 0,
            sync["physical_limit_s"] or 0,
            allreduce["seconds"] or 0,
        ],
        color=["tab:green", "tab:olive", "tab:gray", "tab:red"],
    )
    axes[1].tick_params(axis="x", labelsize=8)
    axes[1].set_yscale("log")
    axes[1].set_title(f"seconds per sync round ({report['plan']['slow_mbit']:g} Mbit/s links)")
    runs = ("selective", "none", "chain-only-selective", "chain-only-none")
    chain = [report["swarms"][m]["chain_tokens_per_s"] or 0 for m in runs]
    anchor = report["swarms"]["selective"]["anchor"]["tokens_per_s"] or 0
    axes[2].bar(
        [
            "chain k\n(swarm)",
            "chain d\n(swarm)",
            "chain k\n(alone)",
            "chain d\n(alone)",
            "anchor\n(swarm)",
            "train\n(2 cores)",
            "anchor\n(1 core)",
            "train\n(1 core)",
        ],
        [
            *chain,
            anchor,
            report["local_tokens_per_s"],
            report["anchor_alone_tokens_per_s"] or 0,
            report["local_one_core_tokens_per_s"] or 0,
        ],
        color=["tab:green", "tab:orange", "tab:green", "tab:orange"] + ["tab:blue", "tab:gray"] * 2,
    )
    axes[2].tick_params(axis="x", labelsize=8)
    axes[2].set_title("training tokens/s")
    run = report["config"]
    fig.suptitle(
        f"hetnode bench network: {run['run']} ({run['parameters'] / 1e6:.2f} M params), H={run['H']}"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
