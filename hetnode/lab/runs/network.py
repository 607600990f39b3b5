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
give the bytes on the wire, DHT traffic included. Results: `network.json` and `network.png`. This module runs
the lab; `network_plan.py` holds what it runs, `network_report.py` what it makes of the results.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch

from hetnode.config import Config, dump_config, replace
from hetnode.data import TokenDataset
from hetnode.errors import HetnodeError
from hetnode.lab.guard import (
    STALL_ROUNDS,
    LabStalled,
    check_running,
    interruptible,
    lab_session,
    shielded,
    stalled_reason,
)
from hetnode.lab.netlab.hosts import NetLab, check_lab_possible
from hetnode.lab.procs import LabProcess, stop_all
from hetnode.lab.runs.network_plan import (
    ANCHOR_MBIT,
    ANCHORS,
    LAB_TIMINGS,
    SOLO_CORES,
    STAGES,
    NetworkPlan,
    check_plan,
    lab_rates,
)
from hetnode.lab.runs.network_report import plot_network, summarise
from hetnode.lab.swarm import Member, merged_history, read_jsonl, running_swarm
from hetnode.model import build_model, count_parameters
from hetnode.training.trainer import InnerTrainer

log = logging.getLogger(__name__)

ROUND_LOG = "rounds-local.jsonl"  # written by every daemon (hetnode/service/round_log.py)
HISTORY = "rounds.jsonl"  # the coordinator's sealed rounds
STOP_GRACE_S = 5.0  # for the daemons to exit on SIGTERM before they are killed


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
