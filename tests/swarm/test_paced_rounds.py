"""Paced rounds over real daemons (`outer.schedule = "paced"`, docs/sync.md "Paced rounds"): an anchor held
to a quarter of a core trains fewer steps than a free one in the same rounds, instead of holding every
round to its pace; both are in every seal, hold the coordinator's θ bit for bit, and are weighed and
credited by their own steps. A third anchor on a quarter core announces twice the steps it took and a
floor of steps that takes a day (a test hook, `anchor_hooks.py`): the seal counts only the steps its update
shows, so it gains neither weight nor credit over the honest one of its speed, and the budget never grows
past the fastest anchor's time for its cap."""

import os
import re
import sys
from pathlib import Path

import pytest

from hetnode.lab.cpu_quota import CPU_ROOT, CpuQuotas
from hetnode.service.round_log import read_rounds

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        os.geteuid() != 0 or not (CPU_ROOT / "cpu.cfs_quota_us").exists(),
        reason="needs root and the cgroup-v1 cpu controller (a fixed CPU share for the slow anchors)",
    ),
]

ROOT = Path(__file__).resolve().parents[2]
OVERCLAIM = [sys.executable, str(ROOT / "tests" / "swarm" / "anchor_hooks.py")]
H = 20
PACED = {"schedule": "paced", "inner_steps": H, "min_inner_steps": 1, "max_inner_steps": 2 * H}


def test_slow_anchors_train_fewer_steps_in_the_same_rounds_and_a_claim_of_more_gains_nothing(swarm):
    with CpuQuotas({"slow": 0.25, "liar": 0.25}) as quotas:
        boot = swarm.bootstrap(swarm.config(outer=PACED))
        boot.wait_ready()
        fast = swarm.join("fast", boot.maddr, "1000")
        slow = swarm.join("slow", boot.maddr, "1000", prefix=quotas.prefix("slow"))
        liar = swarm.join("liar", boot.maddr, "1000", prefix=quotas.prefix("liar"), command=OVERCLAIM)
        for daemon in (fast, slow, liar):
            daemon.wait_ready()
        everyone = {fast.peer_id, slow.peer_id, liar.peer_id}

        def paced_rounds(history):  # sealed with all three, trained under the budget of the seal before
            budgeted = {e["round"] + 1 for e in history if e["budget_s"]}  # (the first rounds run H steps)
            return [e for e in history if set(e["contributors"]) == everyone and e["round"] in budgeted]

        history = swarm.wait_for_history(
            lambda h: len(paced_rounds(h)) >= 5, timeout=300, what="five paced rounds with all three anchors"
        )
        paced = paced_rounds(history)
        taken = {
            int(m[1]): int(m[2])
            for m in re.finditer(r"overclaim: round (\d+) took (\d+) steps", liar.tail(400))
        }
        for entry in paced:
            steps, weights, credits = entry["steps"], entry["weights"], entry["credits"]
            assert all(1 <= n <= 2 * H for n in steps.values()), entry
            assert steps[slow.peer_id] < steps[fast.peer_id], entry  # the same round, fewer steps
            # weight counts steps (earned weight × steps), credit follows them up to H
            assert weights[slow.peer_id] < weights[fast.peer_id], entry
            for daemon in (slow, fast):
                assert credits[daemon.peer_id]["steps"] == min(steps[daemon.peer_id], H), (daemon.name, entry)
            # the liar claimed twice what it took; the seal counted what its update shows (its error
            # feedback carries some of the rounds before: a round may show a step or two more)
            took = taken[entry["round"]]
            assert steps[liar.peer_id] < 2 * took or took == 1, (entry, took)

        # over the rounds, the liar weighs and earns no more than the honest anchor of its speed, per unit of
        # the weight its verified history earned (the same rule for both; one that joined a round earlier
        # is a round further out of probation: measured in CI, 1.46x the credit with 1.08x the steps). Its
        # claim was 2x; the estimate of what an update shows moves by up to a fifth under load (1.32x in
        # one CI run), so the bound is 1.4x: far below what the claim would have given
        def per_earned(peer, value_of):
            return sum(value_of(e) * e["steps"][peer] / e["weights"][peer] for e in paced)

        def credit(peer):
            return per_earned(peer, lambda e: e["credits"][peer]["tokens"])

        credits = credit(liar.peer_id), credit(slow.peer_id)
        table = [
            (
                e["round"],
                *(
                    (e["steps"][p], e["weights"][p], e["credits"][p]["tokens"])
                    for p in (liar.peer_id, slow.peer_id)
                ),
            )
            for e in paced
        ]  # (round, (steps, weight, credit) of the liar, of the slow one): the failure's evidence
        assert credits[0] <= 1.4 * credits[1], (credits, table)
        liar_weight = per_earned(liar.peer_id, lambda e: e["weights"][liar.peer_id])  # Σ counted steps
        assert liar_weight <= 1.4 * per_earned(slow.peer_id, lambda e: e["weights"][slow.peer_id])
        # once all had trained, every seal had all three: the slow ones neither stretched nor missed a round
        first = min(e["round"] for e in history if set(e["contributors"]) == everyone)
        later = [e for e in history if e["round"] > first]
        assert later and all(set(e["contributors"]) == everyone for e in later), later
        budgets = [e["budget_s"] for e in history if e["round"] + 1 in {p["round"] for p in paced}]
        assert budgets and all(0.5 <= b <= 600 for b in budgets), budgets
        # the liar's day-long floor raises the budget at most to the fast anchor's time for its cap
        fast_log = {r["round"]: r for r in read_rounds(swarm.tmp_path / fast.name)}
        step_s = max(r["train_s"] / r["steps"] for r in fast_log.values() if r["steps"])
        assert all(b <= 1.5 * 2 * H * step_s for b in budgets), (step_s, budgets)

        document = swarm.wait_for(
            boot.maddr,
            lambda d: all(
                (p.get("params_round") or -1) >= paced[-1]["round"]
                for p in d["peers"]
                if p["name"] in ("fast", "slow", "liar")
            ),
            timeout=60,
            what="the anchors hold the last paced round",
        )
        swarm.agree_with_coordinator(document, {"fast", "slow", "liar"})
        # each honest anchor announced the steps it took (its round log), and the seal took them or a few
        # fewer: what its update shows is an estimate against the other updates' norms (the yardstick),
        # which error feedback and the machine's load move (measured under load: 14 of 15, 22 of 26 in the
        # first paced rounds, where error feedback still carries the fixed-H first round; 34 of 37 later).
        # Never more than it took, never less than 4/5 of it, and over the rounds at least 9/10 (measured
        # with another test run beside it: 176 of 181)
        for daemon in (fast, slow):
            logged = {r["round"]: r["steps"] for r in read_rounds(swarm.tmp_path / daemon.name)}
            counted_took = [
                (entry["steps"][daemon.peer_id], logged[entry["round"]])
                for entry in paced
                if entry["round"] in logged
            ]
            assert all(0.8 * took <= counted <= took for counted, took in counted_took), (daemon.name, logged)
            counted, took = (sum(column) for column in zip(*counted_took, strict=True))
            assert counted >= 0.9 * took, (daemon.name, counted_took)
