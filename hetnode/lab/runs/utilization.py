"""`hetnode bench utilization`: how much of the wall time a replica trains, lockstep against overlapped
rounds, side by side in one run (issue 31; root, the netns lab, real daemons).

The lab: a coordinator, three anchors on 50 Mbit/s links (the third held to a quarter of the others' CPU
share: a slower machine) and a chain of two stages on 8 Mbit/s links, every host 10 ms one way from the lab's
core (the user-space WAN emulator, `hetnode/lab/netlab/wan_emulator.py`), so any two of them are 40 ms RTT
apart. Each daemon runs under a CPU quota of its own (`hetnode/lab/cpu_quota.py`): while it waits for the
network nobody else can use its share.

Five swarm runs, each a fresh swarm, for the same wall-clock budget counted from the first seal once every
replica trained and synced a round: the rules `lockstep` (H steps, train then sync), `overlap`
(`outer.overlap`), `paced` (`outer.schedule = "paced"`: a round has a time budget and each replica trains
the steps that fit, docs/sync.md "Paced rounds") and `paced+overlap`; then a shorter run of the overlap
rule with `outer.verify = false`, for the coordinator's seal-to-seal time without verification.
The figures come from each daemon's own `rounds-local.jsonl` and the coordinator's `rounds.jsonl`
(`hetnode/lab/runs/utilization_figures.py`); each replica's layer digests are checked against the
coordinator's at the end of each run. Results: `utilization.json` and `utilization.png`. This module runs
the swarms; `utilization_plan.py` holds what they run, `utilization_report.py` what is made of them.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import time
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any

from hetnode.config import Config, dump_config
from hetnode.errors import HetnodeError
from hetnode.lab.cpu_quota import CpuQuotas, check_quotas_possible
from hetnode.lab.guard import LabStalled, check_running, interruptible, stalled_reason
from hetnode.lab.netlab.hosts import check_lab_possible
from hetnode.lab.procs import HETNODE
from hetnode.lab.runs import soak_checks
from hetnode.lab.runs.utilization_figures import measured, start_seal, utilization
from hetnode.lab.runs.utilization_plan import (
    ANCHORS,
    NO_VERIFY_RULE,
    RULES,
    SLOW_ANCHOR,
    STAGES,
    UtilizationPlan,
    capped_label,
    check_plan,
    lab_config,
    lab_links,
    shares,
)
from hetnode.lab.runs.utilization_report import plot, summarise
from hetnode.lab.swarm import Member, RunningSwarm, running_swarm

RUN_RECORD = "run.json"  # per rule, in its work folder: what the report is made from
ONE_THREAD = ["env", "OMP_NUM_THREADS=1"]  # a fraction of a core: one torch thread, not one per core
MISMATCH_LINE = "layer digests differ from the coordinator's"  # hetnode/daemon/participant.py


# --- one run -----------------------------------------------------------------------------------------


def run_rule(
    config: Config,
    plan: UtilizationPlan,
    work: Path,
    label: str,
    budget_s: float,
    say: Callable[[str], None],
    check: bool = True,
) -> dict[str, Any]:
    """A fresh swarm under `config` for `budget_s` after its start seal (`start_seal`); what it
    logged, with the digests checked at its end when `check`."""
    shutil.rmtree(work, ignore_errors=True)  # no identities, checkpoints or logs from before
    work.mkdir(parents=True)
    config_path = work / "swarm.toml"
    config_path.write_text(dump_config(config))
    members = [Member(a, "anchor", plan.anchor_mbit) for a in ANCHORS]
    members += [Member(s, "stage", plan.stage_mbit) for s in STAGES]
    load_before = os.getloadavg()
    with CpuQuotas(shares(plan)) as quotas:
        prefix = lambda name: quotas.prefix(name) + ONE_THREAD  # noqa: E731 - a local shorthand
        links = lab_links(plan)
        with running_swarm(
            config_path, work, links, members, say, prefix, plan.ready_timeout_s, lab_seed=0
        ) as swarm:
            first, running = _wait_for_start(swarm, plan, label, say)
            end = float(first["time"]) + budget_s
            _follow(swarm, label, first, end, plan, say)
            if check:
                say(f"{label}: budget spent; checking every replica's digests against the coordinator's")
            digests = check_digests(swarm) if check else []
            throttling = {name: quotas.throttling(name) for name in quotas.folders}
    names = (*ANCHORS, *STAGES)
    return {
        "label": label,
        "overlap": config.outer.overlap,
        "schedule": config.outer.schedule,
        "verify": config.outer.verify,
        "budget_s": budget_s,
        "peer_ids": swarm.ids,
        "start_round": first["round"],
        "running_at_start": running,
        "t0": float(first["time"]),
        "end": end,
        "history": swarm.history(),
        "round_logs": {name: swarm.round_log(name) for name in names},
        "digest_checks": digests,
        "digest_mismatches_logged": {name: logged_mismatches(work / f"{name}.log") for name in names},
        "throttling": throttling,
        "load_average": {"before": load_before, "after": os.getloadavg()},
    }


def _wait_for_start(
    swarm: RunningSwarm, plan: UtilizationPlan, label: str, say: Callable[[str], None]
) -> tuple[dict[str, Any], str]:
    """(the start seal, who ran at it): the first seal once every replica has trained and synced a
    round (`start_seal`); if the slow anchor or the chain has not `chain_wait_s` after the other anchors
    did (it cannot keep up with them), the newest seal then, without it. Ends with the daemons' roles when
    not even the other anchors sync a round within the plan's start timeout."""
    deadline = time.monotonic() + plan.start_timeout_s
    anchors_at: float | None = None
    say(f"{label}: waiting for the anchors and the chain to train and sync a round")
    while time.monotonic() < deadline:
        check_running(swarm.processes)
        history = swarm.history()
        logs = {name: swarm.round_log(name) for name in (*ANCHORS, *STAGES)}
        first = start_seal(history, logs)
        if first is not None:
            say(f"{label}: every replica runs; measuring from round {first['round']}'s seal")
            return first, "every replica"
        fast = {a: logs[a] for a in ANCHORS if a != SLOW_ANCHOR}
        if anchors_at is None and start_seal(history, fast) is not None:
            anchors_at = time.monotonic()
        if anchors_at is not None and time.monotonic() - anchors_at >= plan.chain_wait_s:
            late = [name for name in (SLOW_ANCHOR, *STAGES) if not logs[name]]
            say(
                f"{label}: {', '.join(late)} synced no round in {plan.chain_wait_s:g} s after the other "
                f"anchors did; measuring from round {history[-1]['round']}'s seal all the same"
            )
            return history[-1], f"without {', '.join(late)}: no round synced yet"
        time.sleep(1.0)
    raise LabStalled(
        f"{label}: the anchors trained and synced no round within {plan.start_timeout_s:.0f} s; the "
        "daemons' roles:\n" + stalled_reason(swarm.processes, swarm.logs())
    )


def _follow(
    swarm: RunningSwarm,
    label: str,
    first: dict[str, Any],
    end: float,
    plan: UtilizationPlan,
    say: Callable[[str], None],
) -> None:
    """Until `end`: a line per sealed round (contributors, eval loss, each replica's utilisation so far)."""
    shown, t0, budget = first["round"], float(first["time"]), end - float(first["time"])
    while time.time() < end:
        check_running(swarm.processes)
        history = swarm.history()
        evaluated = [e for e in history if isinstance(e.get("eval_loss"), int | float)]
        loss = f"{evaluated[-1]['eval_loss']:.3f} (r{evaluated[-1]['round']})" if evaluated else "-"
        for entry in history:
            if entry["round"] <= shown:
                continue
            shown = entry["round"]
            util = []
            for name in (*ANCHORS, *STAGES):
                rounds = measured(swarm.round_log(name), first["round"] + plan.warmup_rounds, end)
                value = utilization(rounds)
                util.append(f"{name[0]}{name[-1]} {'  - ' if value is None else f'{value:.2f}'}")
            say(
                f"{label:<9} {entry['time'] - t0:5.0f}/{budget:.0f} s  round {entry['round']:>3}  "
                f"{len(entry['contributors'])} in seal, {len(entry.get('excluded') or ())} left out  "
                f"eval loss {loss}  "
                f"utilisation {' '.join(util)}"
            )
        time.sleep(1.0)


def status_document(swarm: RunningSwarm) -> dict[str, Any] | None:
    """`hetnode status --json` from inside the coordinator's namespace (None if it failed)."""
    host = swarm.lab.hosts["coordinator"]
    argv = [*host.prefix, *HETNODE, "status", "--peer", swarm.coordinator.maddr, "--json", "--timeout", "20"]
    result = subprocess.run(argv, capture_output=True, text=True, timeout=60)
    try:
        return json.loads(result.stdout) if result.returncode == 0 else None
    except ValueError:
        return None


def check_digests(swarm: RunningSwarm, tries: int = 2) -> list[dict[str, Any]]:
    """Every replica's digests against the coordinator's for the round it holds (as the soak checks
    them); asked again while some replica holds a round the coordinator has not written down yet."""
    checks: list[dict[str, Any]] = []
    for _ in range(tries):
        document = status_document(swarm)
        if document is not None:
            found = soak_checks.check_digests(document.get("peers", []), swarm.history())
            checks = [asdict(c) for c in found]
            if checks and all(c["verdict"] != "unknown-round" for c in checks):
                break
        time.sleep(2.0)
    return checks


def logged_mismatches(log: Path) -> int:
    """Rounds after which a replica found its digests differ from the coordinator's (it downloaded θ)."""
    if not log.exists():
        return 0
    return len(re.findall(re.escape(MISMATCH_LINE), log.read_text(errors="replace")))


# --- the benchmark --------------------------------------------------------------------------------------


def run_benchmark(
    config: Config, plan: UtilizationPlan, out: Path, progress: bool = True, command: str | None = None
) -> dict[str, Any]:
    """The five runs, `utilization.json` and `utilization.png` in `out`; `command`: the command line, for
    the record."""
    check_plan(config, plan)  # before root: a plan is a plan
    check_lab_possible()
    check_quotas_possible()
    say = (lambda text: print(f"[bench utilization] {text}", flush=True)) if progress else (lambda text: None)
    out.mkdir(parents=True, exist_ok=True)
    work = out / "work"
    runs: dict[str, dict[str, Any]] = {}
    overlap, paced = RULES[NO_VERIFY_RULE]
    quiet = lab_config(config, plan, overlap=overlap, verify=False, schedule=paced)
    schedule = [
        (label, lab_config(config, plan, overlap=overlap, verify=True, schedule=paced), plan.budget_s, True)
        for label, (overlap, paced) in RULES.items()
        if label in plan.rules
    ]
    for cap in plan.extra_caps:
        capped = lab_config(config, plan, overlap=True, verify=True, schedule="paced", cap_ratio=cap)
        schedule.append((capped_label(cap), capped, plan.budget_s, True))
    # the third run reads only its seal-to-seal time: its digests go unchecked (a status read costs ~30 s)
    schedule.append((f"{NO_VERIFY_RULE}-no-verify", quiet, plan.no_verify_budget_s, False))
    with interruptible():  # SIGTERM unwinds as Ctrl+C does: every lab and cgroup below is removed
        for label, rule_config, budget_s, check in schedule:
            o = rule_config.outer
            say(
                f"{label}: outer.overlap = {str(o.overlap).lower()}, outer.schedule = {o.schedule}, "
                f"outer.verify = {str(o.verify).lower()}, H = {plan.inner_steps}, {budget_s:g} s"
            )
            try:
                runs[label] = run_rule(rule_config, plan, work / label, label, budget_s, say, check)
            except LabStalled as exc:  # reported with the runs that worked, not instead of them
                say(f"{label}: {exc}")
                runs[label] = {"label": label, "error": str(exc)}
            # what the report is made from, kept: `--resummarise` reads it again after a change of measure
            (work / label).mkdir(parents=True, exist_ok=True)
            (work / label / RUN_RECORD).write_text(json.dumps(runs[label]))
    return write_report(config, plan, runs, out, command or "hetnode bench utilization")


def write_report(
    config: Config, plan: UtilizationPlan, runs: dict[str, dict[str, Any]], out: Path, command: str
) -> dict[str, Any]:
    report = summarise(config, plan, runs, command)
    (out / "utilization.json").write_text(json.dumps(report, indent=2))
    plot(report, out / "utilization.png")
    return report


def resummarise(config: Config, out: Path) -> dict[str, Any]:
    """`utilization.json` and `.png` again from the runs a benchmark left in `out/work` (their
    `run.json`), under the plan and command it recorded: a change of measure without a new lab run."""
    runs = {
        path.parent.name: json.loads(path.read_text()) for path in sorted(out.glob(f"work/*/{RUN_RECORD}"))
    }
    if not runs or not (out / "utilization.json").exists():
        raise HetnodeError(
            f"no {RUN_RECORD} under {out / 'work'} or no utilization.json in {out}: "
            f"run the benchmark with --out {out} first"
        )
    earlier = json.loads((out / "utilization.json").read_text())
    tuples = {k: tuple(v) for k, v in earlier["plan"].items() if isinstance(v, list)}
    plan = UtilizationPlan(**(earlier["plan"] | tuples))
    return write_report(config, plan, runs, out, earlier["command"] + " (resummarised)")
