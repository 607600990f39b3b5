"""The cases of `hetnode bench chains` (`hetnode/lab/runs/chains.py` runs each in a fresh swarm): how each one
follows its swarm (a progress line per sealed round, waits on the coordinator's history that end when a
condition holds or say why they did not) and what it does to it (a worker killed, a spare's step-in, a liar
read out of the status)."""

from __future__ import annotations

import json
import signal
import subprocess
import time
from collections.abc import Callable
from typing import Any

from hetnode.lab.guard import LabStalled, check_running, stalled_reason
from hetnode.lab.procs import HETNODE
from hetnode.lab.runs.chains_figures import (
    BLAME_LINE,
    dropped_by_chain,
    first_seal_with,
    first_stage,
    logged_at,
    sealed_with,
)
from hetnode.lab.runs.chains_plan import CASES, FIRST, LIAR, SECOND, ChainsPlan
from hetnode.lab.swarm import RunningSwarm
from hetnode.service.http_server import DEFAULT_STATUS_PORT

NEW_ROUND_TIMEOUT_S = 60.0  # for a worker to log its next round before it is killed


class Watch:
    """One case's swarm, followed: a progress line per sealed round, and waits on the coordinator's history
    that end when a condition holds or say why they did not. `exempt`: daemons stopped on purpose."""

    def __init__(self, swarm: RunningSwarm, case: str, say: Callable[[str], None], t0: float) -> None:
        self.swarm, self.case, self.say, self.t0 = swarm, case, say, t0
        self.names = {peer: name for name, peer in swarm.ids.items()}
        self.shown = -1
        self.exempt: set[str] = set()

    def history(self) -> list[dict]:
        check_running([p for p in self.swarm.processes if p.name not in self.exempt])
        history = self.swarm.history()
        evaluated = [e for e in history if isinstance(e.get("eval_loss"), int | float)]
        loss = (
            f"  eval loss {evaluated[-1]['eval_loss']:.3f} (r{evaluated[-1]['round']})" if evaluated else ""
        )
        for entry in history:
            if entry["round"] <= self.shown:
                continue
            self.shown = entry["round"]
            sealed = sorted(self.names.get(p, p[-6:]) for p in entry.get("contributors") or ())
            self.say(
                f"{self.case:<16} {float(entry['time']) - self.t0:5.0f} s  round {entry['round']:>3}  "
                f"sealed: {' '.join(sealed) or '-'}{loss}"
            )
        return history

    def until(self, done: Callable[[list[dict]], bool], timeout_s: float, what: str) -> list[dict]:
        deadline = time.monotonic() + timeout_s
        while True:
            history = self.history()
            if done(history):
                return history
            if time.monotonic() >= deadline:
                raise LabStalled(
                    f"{self.case}: {what}: not within {timeout_s:.0f} s; the daemons' roles:\n"
                    + stalled_reason(self.swarm.processes, self.swarm.logs())
                )
            time.sleep(1.0)

    def next_round_of(self, name: str) -> None:
        """Until `name` logs its next round (a stage logs one once the seal is applied: its next round has
        begun), then a second more: its first micro-batches of the round are on their way."""
        logged = len(self.swarm.round_log(name))
        self.until(
            lambda _: len(self.swarm.round_log(name)) > logged, NEW_ROUND_TIMEOUT_S, f"{name} logs a round"
        )
        time.sleep(1.0)

    def kill(self, name: str) -> float:
        process = next(p for p in self.swarm.processes if p.name == name)
        self.exempt.add(name)
        process.proc.send_signal(signal.SIGKILL)
        killed_at = time.time()
        process.proc.wait(10)
        self.say(f"{self.case}: killed {name} (SIGKILL) at {killed_at - self.t0:.0f} s")
        return killed_at


def served_status(swarm: RunningSwarm) -> dict[str, Any] | None:
    """The status document the coordinator serves (`hetnode status --peer http://…` from inside its namespace:
    one HTTP request, no DHT read); None when it did not answer."""
    url = (swarm.coordinator.ready or {}).get("http") or f"http://127.0.0.1:{DEFAULT_STATUS_PORT}"
    host = swarm.lab.hosts["coordinator"]
    argv = [*host.prefix, *HETNODE, "status", "--peer", url, "--json", "--timeout", "10"]
    try:
        result = subprocess.run(argv, capture_output=True, text=True, timeout=40)
        return json.loads(result.stdout) if result.returncode == 0 else None
    except (subprocess.TimeoutExpired, ValueError):
        return None


def whole_chain(watch: Watch, plan: ChainsPlan, case: str) -> dict:
    """The first round sealed with the first stage and `stage_workers` second-stage peers (malicious_worker:
    one; its liar may join the pool later, or be caught before its work was ever sealed)."""
    ids = watch.swarm.ids
    want = 1 if case == "malicious_worker" else CASES[case][0]
    second = [ids[n] for n in SECOND if n in ids]

    def whole(entry: dict) -> bool:
        sealed = set(entry.get("contributors") or ())
        return ids[FIRST] in sealed and len(sealed & set(second)) >= want

    watch.say(f"{case}: waiting for a round sealed with the whole chain ({want} second-stage worker(s))")
    history = watch.until(
        lambda h: any(whole(e) for e in h), plan.start_timeout_s, "a round sealed with the chain"
    )
    return next(e for e in history if whole(e))


def _measure(watch: Watch, plan: ChainsPlan, record: dict[str, Any]) -> None:
    """one_worker, two_workers: rounds for `measure_s` from the first seal with the whole chain."""
    record["end"] = record["t0"] + plan.measure_s
    watch.until(lambda _: time.time() >= record["end"], plan.measure_s + 30, "the measured window")


def _second_stage(watch: Watch, record: dict[str, Any]) -> list[str]:
    """The second stage's workers by name: as the status showed them (`first_stage`: the chain as it
    formed), else whoever was sealed with stage-0."""
    chain = record.get("layout_before") or {}
    names = chain.get("names") or []
    if len(names) > 1:
        return list(names[1])
    ids = watch.swarm.ids
    start = next(e for e in watch.swarm.history() if e["round"] == record["start_round"])
    return [n for n in SECOND if n in ids and ids[n] in start["contributors"]]


def _kill_a_worker(watch: Watch, plan: ChainsPlan, record: dict[str, Any]) -> None:
    """worker_killed: a few rounds sealed with both workers, one of them killed a second into a round, then
    rounds sealed with the chain until it is back up to speed."""
    ids, lead = watch.swarm.ids, first_stage(record)
    pool = _second_stage(watch, record)
    both = {ids[lead], *(ids[n] for n in pool)}
    watch.until(
        lambda h: sum(sealed_with(e, both) for e in h) >= plan.rounds_before_event,
        plan.event_timeout_s,
        f"{plan.rounds_before_event} rounds sealed with both workers",
    )
    victim = pool[0]
    watch.next_round_of(victim)
    killed_at = watch.kill(victim)
    record["events"] |= {"killed": victim, "killed_at": killed_at, "pool": pool}
    watch.until(
        lambda h: (
            sum(float(e["time"]) > killed_at and sealed_with(e, {ids[lead]}) for e in h)
            >= plan.rounds_after_event
        ),
        plan.event_timeout_s,
        f"{plan.rounds_after_event} rounds sealed with the chain after the kill",
    )


def _spare_steps_in(watch: Watch, plan: ChainsPlan, record: dict[str, Any]) -> None:
    """spare: the chain's second stage killed; its spare takes the stage (the successor, same lineage)."""
    ids, lead = watch.swarm.ids, first_stage(record)
    member = (_second_stage(watch, record) or list(SECOND))[0]
    spare = next(n for n in (FIRST, *SECOND) if n in ids and n not in (lead, member))
    watch.until(
        lambda h: sum(sealed_with(e, {ids[lead], ids[member]}) for e in h) >= plan.rounds_before_event,
        plan.event_timeout_s,
        f"{plan.rounds_before_event} rounds sealed with the chain",
    )
    watch.next_round_of(member)
    killed_at = watch.kill(member)
    record["events"] |= {"killed": member, "killed_at": killed_at, "spare": spare}
    successor = {ids[lead], ids[spare]}
    history = watch.until(
        lambda h: (
            sum(float(e["time"]) > killed_at and sealed_with(e, successor) for e in h)
            >= plan.rounds_after_event
        ),
        plan.event_timeout_s,
        f"{plan.rounds_after_event} rounds sealed with the spare in the chain",
    )
    first = first_seal_with(history, successor, killed_at)
    watch.say(
        f"spare: the successor's first round sealed {float(first['time']) - killed_at:.1f} s after the kill"
    )


def _catch_the_liar(watch: Watch, plan: ChainsPlan, record: dict[str, Any]) -> None:
    """malicious_worker: the status read every `status_poll_s` from shortly before the liar turns until its
    chain blames or drops it; then rounds sealed with the chain without it."""
    ids = watch.swarm.ids
    lock = watch.swarm.work / LIAR / "daemon.lock"  # written as its daemon starts, when its fault clock does
    started, source = (
        (lock.stat().st_mtime, "daemon.lock") if lock.exists() else (record["ready_at"], "ready")
    )
    fault_at = started + plan.fault_after_s
    record["events"] |= {"liar": LIAR, "fault_at": fault_at, "fault_clock_from": source, "status_reads": []}
    watch.say(f"malicious_worker: {LIAR} turns at {fault_at - watch.t0:.0f} s; reading the status from then")
    deadline = max(time.time(), fault_at) + plan.event_timeout_s
    reads = record["events"]["status_reads"]
    while True:
        watch.history()
        now = time.time()
        if now >= fault_at - 2 * plan.status_poll_s:
            dropped = dropped_by_chain(served_status(watch.swarm), ids[LIAR])
            reads.append({"time": time.time(), "dropped": dropped})
            if dropped:
                record["events"]["dropped_seen_at"] = reads[-1]["time"]
                watch.say(
                    f"malicious_worker: the status shows {LIAR} blamed "
                    f"({now - fault_at:+.1f} s from the fault)"
                )
                break
        if now >= deadline:
            raise LabStalled(
                f"malicious_worker: {LIAR} not blamed within {plan.event_timeout_s:.0f} s of its fault; the "
                "daemons' roles:\n" + stalled_reason(watch.swarm.processes, watch.swarm.logs())
            )
        time.sleep(plan.status_poll_s)
    seen = record["events"]["dropped_seen_at"]
    lead = first_stage(record)
    log = watch.swarm.work / f"{lead}.log"  # the first stage's: it caught the lie
    text = log.read_text(errors="replace") if log.exists() else ""
    record["events"]["blame_logged_at"] = logged_at(text, f"{ids[LIAR]} {BLAME_LINE}", fault_at)
    watch.until(
        lambda h: (
            sum(float(e["time"]) > seen and sealed_with(e, {ids[lead]}) for e in h) >= plan.rounds_after_event
        ),
        plan.event_timeout_s,
        f"{plan.rounds_after_event} rounds sealed with the chain after the liar was dropped",
    )


ACTIONS: dict[str, Callable[[Watch, ChainsPlan, dict[str, Any]], None]] = {
    "one_worker": _measure,
    "two_workers": _measure,
    "worker_killed": _kill_a_worker,
    "spare": _spare_steps_in,
    "malicious_worker": _catch_the_liar,
}
