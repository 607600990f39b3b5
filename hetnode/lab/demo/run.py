"""`hetnode demo`: start a swarm, watch it for T sealed rounds, check that every replica holds the
coordinator's θ, stop everything in order and write the report.

Whatever ends the run (T rounds, Ctrl+C or SIGTERM, a child that failed), the same `finally` stops the
peers first and the coordinator last, kills only what hangs, and writes the report from what exists.
"""

from __future__ import annotations

import logging
import os
import shutil
import signal
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hetnode.config import Config, dump_config, load_config, replace
from hetnode.errors import ConfigError, HetnodeError
from hetnode.lab.demo.digests import compare_digests, hold_round
from hetnode.lab.demo.live import LiveView
from hetnode.lab.demo.plots import PLOTS
from hetnode.lab.demo.report import DemoRecord, result_line, stopping_line, summarise, write_report
from hetnode.lab.demo.rounds import replicas_text, swarm_counts
from hetnode.lab.demo.swarm import DemoSwarm, SwarmPlan, read_jsonl
from hetnode.lab.netlab.hosts import check_lab_possible
from hetnode.lab.procs import Interrupted
from hetnode.lab.swarm import COORDINATOR
from hetnode.service.round_log import ROUND_LOG

log = logging.getLogger(__name__)

QUICK_INNER_STEPS = 10  # H for --quick: a round every few seconds on two cores
DIGEST_WAIT_S = 90.0  # for every replica to apply the last round
EVAL_WAIT_S = 60.0  # for the coordinator to evaluate the last round (beside the seal, after it)
EXIT_CODES = {"finished": 0, "interrupted": 130, "failed": 1}


@dataclass(frozen=True)
class DemoOptions:
    config_path: Path
    out: Path
    rounds: int
    anchors: int = 2
    chains: int = 1
    stages: int | None = None  # None: the config's pipeline.stages
    workers: int = 1  # workers on each chain's slowest stage (pipeline.stage_workers)
    edge_mbit: float = 20.0
    quick: bool = False
    shaped: bool = False


def prepare_config(options: DemoOptions) -> Config:
    """The config the swarm runs: --quick lowers H, --chain-stages sets the chain length."""
    config = load_config(options.config_path)
    if options.quick and config.outer.inner_steps > QUICK_INNER_STEPS:
        config = replace(config, "outer", inner_steps=QUICK_INNER_STEPS)
    if options.stages is not None and options.stages != config.pipeline.stages:
        config = replace(config, "pipeline", stages=options.stages)
    if options.workers != config.pipeline.stage_workers:
        config = replace(config, "pipeline", stage_workers=max(options.workers, 1))
    return config


def check_options(options: DemoOptions, config: Config) -> None:
    def bad(flag: str, message: str) -> ConfigError:
        return ConfigError(flag, flag.lstrip("-"), message)

    if options.anchors < 0 or options.chains < 0:
        raise bad("--anchors/--chains", "must be >= 0")
    if not 1 <= options.workers <= 8:
        raise bad("--chain-workers", f"must be in 1..8, got {options.workers}")
    if options.workers > 1 and (options.stages or config.pipeline.stages) < 2:
        raise bad("--chain-workers", "a pool needs a stage past the first: --chain-stages 2 or more")
    if options.anchors + options.chains == 0:
        raise bad("--anchors/--chains", "a swarm needs at least one anchor or one chain")
    if options.rounds < 1:
        raise bad("--rounds", f"must be >= 1, got {options.rounds}")
    if not 0 < options.edge_mbit < 1e6:
        raise bad("--edge-mbit", f"must be in (0, 1e6) Mbit/s, got {options.edge_mbit:g}")
    if options.chains and options.edge_mbit < config.network.stage_min_up_mbps:
        raise bad(
            "--edge-mbit",
            f"{options.edge_mbit:g} Mbit/s is below the config's stage_min_up_mbps "
            f"({config.network.stage_min_up_mbps:g}): the edges would take no role",
        )


@contextmanager
def stop_on_signals(stop: threading.Event) -> Iterator[None]:
    """SIGINT and SIGTERM set `stop` instead of raising, so the shutdown below always runs to its end."""

    def request(signum: int, _frame: Any) -> None:
        again = " again: still stopping, please wait" if stop.is_set() else ": stopping the swarm"
        # os.write, not print: printing while the main thread prints raises a reentrant-call error
        os.write(2, f"\n{signal.Signals(signum).name}{again}\n".encode())
        stop.set()

    previous = {s: signal.signal(s, request) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)


def _clean(out: Path) -> None:
    """A fresh swarm every time: a coordinator that found old state would resume the old run."""
    shutil.rmtree(out / "swarm", ignore_errors=True)
    for name in ("report.md", "summary.json", "config.toml", *PLOTS.values()):
        (out / name).unlink(missing_ok=True)


def run_demo(options: DemoOptions) -> int:
    config = prepare_config(options)
    check_options(options, config)
    if options.shaped:
        check_lab_possible()
    out = options.out.expanduser().resolve()
    out.mkdir(parents=True, exist_ok=True)
    _clean(out)
    config_path = out / "config.toml"
    config_path.write_text(dump_config(config))
    stages = config.pipeline.stages
    plan = SwarmPlan(
        options.anchors, options.chains, stages, options.edge_mbit, options.shaped, workers=options.workers
    )
    stop = threading.Event()
    swarm = DemoSwarm(plan, out / "swarm", stop)
    started = time.monotonic()
    outcome, error, digests, contributions = "failed", None, None, None
    chains: dict[str, dict[str, Any]] = {}
    where = "shaped links in network namespaces" if options.shaped else "loopback"
    print(
        f"hetnode demo: a coordinator, {options.anchors} anchor(s) and {options.chains} chain(s) of "
        f"{stages} stage(s), {stages + options.workers - 1} edge peer(s) each at {options.edge_mbit:g} "
        f"Mbit/s on {where}; {options.rounds} rounds of "
        f"H = {config.outer.inner_steps} ({config.run.name}). Logs: {swarm.work}/*.log",
        flush=True,
    )
    with stop_on_signals(stop):
        try:
            swarm.start(config_path)
            print(f"status page: {swarm.status_where()}   (Ctrl+C stops the demo)", flush=True)
            outcome = watch(swarm, options.rounds, chains)
            if outcome == "finished":
                print("checking that every peer holds the coordinator's θ (layer digests)...", flush=True)
                digests = check_digests(swarm)
                outcome = "interrupted" if stop.is_set() else outcome
                print(
                    digest_line(
                        digests, swarm_counts([m.role for m in plan.members()], stages + options.workers - 1)
                    ),
                    flush=True,
                )
                wait_for_evaluation(swarm, options.rounds)
        except Interrupted:
            outcome = "interrupted"
        except HetnodeError as exc:
            outcome, error = "failed", str(exc)
            print(f"hetnode demo: {exc}", flush=True)
        finally:
            stopping_at = time.time()  # rounds sealed from now on are not the results
            print("stopping the peers, then the coordinator...", flush=True)
            swarm.stop_peers()
            contributions = swarm.fetch("/api/contributions")
            swarm.stop_coordinator()
            swarm.close()
            record = DemoRecord(
                out=out,
                config_path=config_path,
                config=config.to_dict(),
                requested_rounds=options.rounds,
                outcome=outcome,
                wall_s=time.monotonic() - started,
                error=error,
                status_url=swarm.status_url,
                shaped=options.shaped,
                processes=swarm.describe(),
                history=swarm.history(),
                chains=list(chains.values()),
                contributions=contributions,
                digests=digests,
                round_logs={p.name: read_jsonl(swarm.work / p.name / ROUND_LOG) for p in swarm.peers},
                leftovers=swarm.leftovers,
                stopping_at=stopping_at,
            )
            summary = summarise(record)  # what report.md and summary.json say, said last here too
            report = write_report(record, summary)
            print(result_line(summary), flush=True)
            extra = stopping_line(summary)
            if extra:
                print(extra, flush=True)
            print(f"report: {report} (summary.json and plots beside it)", flush=True)
    return EXIT_CODES[outcome]


def watch(swarm: DemoSwarm, total: int, chains: dict[str, dict[str, Any]]) -> str:
    """Refresh the view about once a second until `total` rounds are sealed; 'interrupted' on a signal."""
    with LiveView(total, swarm.status_url) as view:
        while True:
            history = swarm.history()
            status = swarm.fetch("/api/status")
            note_chains(chains, status, history)
            view.update(status, history)
            swarm.track()
            if len(history) >= total:
                return "finished"
            code = swarm.coordinator_exit()
            if code is not None:
                tail = swarm.coordinator.tail(10) if swarm.coordinator else ""
                raise HetnodeError(f"the coordinator exited with code {code}:\n{tail}")
            if swarm.stop.wait(1.0):
                view.update(status, swarm.history())  # the rounds sealed until the signal
                return "interrupted"


def note_chains(
    chains: dict[str, dict[str, Any]], status: dict[str, Any] | None, history: list[dict[str, Any]]
) -> None:
    """Remember every chain the coordinator showed: members by name, liveness, the round it appeared in."""
    if not isinstance(status, dict):
        return
    names = {p.get("peer"): p.get("name") for p in status.get("peers") or [] if isinstance(p, dict)}
    next_round = history[-1].get("round", -1) + 1 if history else 0
    for chain in status.get("chains") or []:
        if not isinstance(chain, dict) or not isinstance(chain.get("chain"), str):
            continue
        seen = chains.setdefault(chain["chain"], {"chain": chain["chain"], "first_seen": next_round})
        seen["members"] = [str(names.get(m) or m) for m in chain.get("members") or []]
        pools = chain.get("workers") or []
        seen["workers"] = [[str(names.get(m) or m) for m in pool] for pool in pools if isinstance(pool, list)]
        if isinstance(chain.get("served"), dict):
            seen["served"] = {str(names.get(p) or p): share for p, share in chain["served"].items()}
        if isinstance(chain.get("dropped"), dict):
            seen["dropped"] = {str(names.get(p) or p): why for p, why in chain["dropped"].items()}
        seen["live"] = bool(chain.get("live"))


def wait_for_evaluation(swarm: DemoSwarm, total: int) -> None:
    """Give the coordinator up to EVAL_WAIT_S to evaluate the rounds the report shows: it evaluates each
    round beside the next seals, and a stop before that leaves the last ones without an eval loss."""
    deadline = time.monotonic() + EVAL_WAIT_S
    while time.monotonic() < deadline and not swarm.stop.is_set():
        history = swarm.history()[:total]
        if all(entry.get("evaluated", True) for entry in history):
            return
        swarm.stop.wait(0.5)


def check_digests(swarm: DemoSwarm) -> dict[str, Any] | None:
    """Wait until every replica applied the last sealed round (cheaply, on the status API), then compare
    each one's published digests (`hetnode status`) with the coordinator's; None when interrupted."""
    history = swarm.history()
    target = history[-1]["round"] if history else 0
    expected = {name: peer for name, peer in swarm.peer_ids().items() if name != COORDINATOR}
    deadline = time.monotonic() + DIGEST_WAIT_S
    while time.monotonic() < deadline:
        status = swarm.fetch("/api/status") or {}
        peers = [p | {"peer_id": p.get("peer")} for p in status.get("peers") or [] if isinstance(p, dict)]
        if hold_round(peers, expected, target) or swarm.stop.wait(1.0):
            break
    document = None
    while not swarm.stop.is_set():
        document = swarm.peer_status()
        if document and hold_round(document.get("peers") or [], expected, target):
            break
        if time.monotonic() > deadline or swarm.stop.wait(1.0):
            break
    if swarm.stop.is_set():
        return None
    return compare_digests((document or {}).get("peers") or [], swarm.history(), expected)


def digest_line(digests: dict[str, Any] | None, counts: dict[str, int]) -> str:
    """`counts`: `rounds.swarm_counts` of the swarm started (a chain of stages is one replica)."""
    if digests is None:
        return "digests: not checked (interrupted)"
    if digests["agree"]:
        held = ", ".join(str(r) for r in digests["rounds"])
        return (
            f"digests: all {len(digests['peers'])} peers of the {replicas_text(counts)} equal the "
            f"coordinator's at round {held}"
        )
    bad = ", ".join(f"{p['name']} ({p['reason']})" for p in digests["peers"] if not p["agree"])
    return f"digests: DISAGREE: {bad}"
