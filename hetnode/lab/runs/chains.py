"""`hetnode bench chains`: a chain of two stages whose second stage may be a pool of workers (docs/chains.md,
"Pools and routing"), in the netns lab (issue 38; root, real daemons).

The lab: a coordinator, one anchor on a 50 Mbit/s link and the stage peers on 8 Mbit/s links, any two hosts
40 ms RTT apart (the WAN emulator), each daemon under a CPU quota of its own with one torch thread
(`hetnode/lab/cpu_quota.py`, as `bench utilization`). The layout is fixed by advertised compute and the
quotas make the second stage the chain's bottleneck (`chains_plan.py`). Five cases, each a fresh swarm, one
after the other:
- `one_worker`: a chain of two (`pipeline.stage_workers = 1`): the chain's tokens/s;
- `two_workers`: a third stage peer joins the second stage's pool (`stage_workers = 2`): the chain's tokens/s;
- `worker_killed`: as two_workers; once the pool sealed a few rounds, one of its workers is killed (SIGKILL)
  a second into a round: the rounds sealed without the chain, and how long until it runs as fast as a
  chain with one worker;
- `spare`: a chain of two and an idle spare (`stage_workers = 1`); the chain's second stage is killed and the
  spare steps in (docs/chains.md, "When a member leaves"): rounds sealed without the chain meanwhile;
- `malicious_worker`: as two_workers, one pool worker turning to gradients ×1000 after a while
  (`--fault grad-scaled --fault-after`): rounds until its chain drops it, and the eval loss against
  two_workers' at equal sealed tokens.
Every case ends with each replica's digests checked against the coordinator's. The figures are defined in
`chains_figures.py`; results: `chains.json` and `chains.png` (`chains_report.py`). This module runs the
swarms; `chains_plan.py` holds what they run, `chains_cases.py` what each case does to its swarm.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any

from hetnode.config import Config, dump_config
from hetnode.errors import HetnodeError
from hetnode.lab.cpu_quota import CpuQuotas, check_quotas_possible
from hetnode.lab.guard import LabStalled, interruptible
from hetnode.lab.netlab.hosts import check_lab_possible
from hetnode.lab.runs import soak_checks, utilization
from hetnode.lab.runs.chains_cases import ACTIONS, Watch, served_status, whole_chain
from hetnode.lab.runs.chains_figures import chain_of
from hetnode.lab.runs.chains_plan import (
    CASES,
    ChainsPlan,
    case_config,
    check_plan,
    lab_links,
    members,
    shares,
)
from hetnode.lab.runs.chains_report import plot, summarise
from hetnode.lab.runs.utilization import ONE_THREAD, logged_mismatches
from hetnode.lab.swarm import RunningSwarm, running_swarm

RUN_RECORD = "run.json"  # per case, in its work folder: what the report is made from


def check_digests(swarm: RunningSwarm, tries: int = 2) -> list[dict[str, Any]]:
    """Every replica's digests against the coordinator's for the round it holds (as `bench utilization`
    checks them, from the served document; from the DHT when the coordinator serves none)."""
    checks: list[dict[str, Any]] | None = None
    for _ in range(tries):
        document = served_status(swarm)
        if document is not None:
            checks = [
                asdict(c) for c in soak_checks.check_digests(document.get("peers", []), swarm.history())
            ]
            if checks and all(c["verdict"] != "unknown-round" for c in checks):
                break
        time.sleep(2.0)
    return utilization.check_digests(swarm) if checks is None else checks


def layout(swarm: RunningSwarm) -> dict[str, Any] | None:
    """The chain the status shows (`chains_figures.chain_of`), its peers also by name."""
    chain = chain_of(served_status(swarm))
    if chain is not None:
        names = {peer: name for name, peer in swarm.ids.items()}
        chain["names"] = [[names.get(p, p) for p in pool] for pool in chain["workers"]]
    return chain


# --- one case --------------------------------------------------------------------------------------------


def run_case(
    config: Config, plan: ChainsPlan, work: Path, case: str, say: Callable[[str], None]
) -> dict[str, Any]:
    """A fresh swarm for `case`: its whole chain sealed, then the case; what it logged, digests checked."""
    shutil.rmtree(work, ignore_errors=True)  # no identities, checkpoints or logs from before
    work.mkdir(parents=True)
    case_cfg = case_config(config, plan, case)
    config_path = work / "swarm.toml"
    config_path.write_text(dump_config(case_cfg))
    load_before = os.getloadavg()
    record: dict[str, Any] = {
        "case": case,
        "run_name": case_cfg.run.name,
        "stage_workers": CASES[case][0],
        "events": {},
    }
    with CpuQuotas(shares(plan, case)) as quotas:
        prefix = lambda name: quotas.prefix(name) + ONE_THREAD  # noqa: E731 - a local shorthand
        with running_swarm(
            config_path, work, lab_links(plan, case), members(plan, case), say, prefix, plan.ready_timeout_s
        ) as swarm:
            ready_at = time.time()
            watch = Watch(swarm, case, say, ready_at)
            start = whole_chain(watch, plan, case)
            record |= {"ready_at": ready_at, "start_round": start["round"], "t0": float(start["time"])}
            record["layout_before"] = layout(swarm)
            say(
                f"{case}: the whole chain sealed round {start['round']}; "
                f"chain {_shown(record['layout_before'])}"
            )
            ACTIONS[case](watch, plan, record)
            record["end"] = record.get("end") or time.time()
            record["layout_after"] = layout(swarm)
            say(f"{case}: checking every replica's digests against the coordinator's")
            record["digest_checks"] = check_digests(swarm)
            record["throttling"] = {name: quotas.throttling(name) for name in quotas.folders}
    names = [m.name for m in members(plan, case)]
    return record | {
        "peer_ids": swarm.ids,
        "boundary_s": case_cfg.network.boundary_s,
        "history": swarm.history(),
        "round_logs": {name: swarm.round_log(name) for name in names},
        "digest_mismatches_logged": {name: logged_mismatches(work / f"{name}.log") for name in names},
        "load_average": {"before": load_before, "after": os.getloadavg()},
    }


def _shown(chain: dict[str, Any] | None) -> str:
    return "not in the status" if chain is None else " -> ".join("+".join(pool) for pool in chain["names"])


# --- the benchmark --------------------------------------------------------------------------------------


def run_benchmark(
    config: Config, plan: ChainsPlan, out: Path, progress: bool = True, command: str | None = None
) -> dict[str, Any]:
    """The cases one after the other, `chains.json` and `chains.png` in `out`; `command`: for the record."""
    check_plan(config, plan)  # before root: a plan is a plan
    check_lab_possible()
    check_quotas_possible()
    say = (lambda text: print(f"[bench chains] {text}", flush=True)) if progress else (lambda text: None)
    out.mkdir(parents=True, exist_ok=True)
    work = out / "work"
    runs: dict[str, dict[str, Any]] = {}
    with interruptible():  # SIGTERM unwinds as Ctrl+C does: every lab and cgroup below is removed
        for case in plan.cases:
            workers, peers = CASES[case]
            say(
                f"{case}: the anchor and {', '.join(peers)}, pipeline.stage_workers = {workers}, "
                f"H = {plan.inner_steps}"
            )
            try:
                runs[case] = run_case(config, plan, work / case, case, say)
            except LabStalled as exc:  # reported with the cases that worked, not instead of them
                say(f"{case}: {exc}")
                runs[case] = {"case": case, "error": str(exc)}
            # what the report is made from, kept: `--resummarise` reads it again after a change of measure
            (work / case).mkdir(parents=True, exist_ok=True)
            (work / case / RUN_RECORD).write_text(json.dumps(runs[case]))
    return write_report(plan, runs, out, command or "hetnode bench chains")


def write_report(
    plan: ChainsPlan, runs: dict[str, dict[str, Any]], out: Path, command: str
) -> dict[str, Any]:
    report = summarise(plan, runs, command)
    (out / "chains.json").write_text(json.dumps(report, indent=2))
    plot(report, out / "chains.png")
    return report


def resummarise(out: Path) -> dict[str, Any]:
    """`chains.json` and `.png` again from the runs a benchmark left in `out/work` (their `run.json`), under
    the plan and command it recorded: a change of measure without a new lab run."""
    runs = {
        path.parent.name: json.loads(path.read_text()) for path in sorted(out.glob(f"work/*/{RUN_RECORD}"))
    }
    if not runs or not (out / "chains.json").exists():
        raise HetnodeError(
            f"no {RUN_RECORD} under {out / 'work'} or no chains.json in {out}: "
            f"run the benchmark with --out {out} first"
        )
    earlier = json.loads((out / "chains.json").read_text())
    tuples = {k: tuple(v) for k, v in earlier["plan"].items() if isinstance(v, list)}
    plan = ChainsPlan(**(earlier["plan"] | tuples))
    order = [case for case in plan.cases if case in runs]
    return write_report(
        plan, {case: runs[case] for case in order}, out, earlier["command"] + " (resummarised)"
    )
