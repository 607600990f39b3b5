"""Paced rounds over real daemons (`outer.schedule = "paced"`, docs/sync.md "Paced rounds"): an anchor held
to a quarter of a core trains fewer steps than a free one in the same rounds, instead of holding every
round to its pace; both are in every seal, hold the coordinator's θ bit for bit, and are credited their
own steps."""

import os

import pytest

from hetnode.bench.cpu_quota import CPU_ROOT, CpuQuotas
from hetnode.service.round_log import read_rounds

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        os.geteuid() != 0 or not (CPU_ROOT / "cpu.cfs_quota_us").exists(),
        reason="needs root and the cgroup-v1 cpu controller (a fixed CPU share for the slow anchor)",
    ),
]

PACED = {"schedule": "paced", "inner_steps": 20, "min_inner_steps": 1, "max_inner_steps": 40}


def test_a_quarter_core_anchor_trains_fewer_steps_in_the_same_rounds_and_is_in_every_seal(swarm):
    with CpuQuotas({"slow": 0.25}) as quotas:
        boot = swarm.bootstrap(swarm.config(outer=PACED))
        boot.wait_ready()
        fast = swarm.join("fast", boot.maddr, "1000")
        slow = swarm.join("slow", boot.maddr, "1000", prefix=quotas.prefix("slow"))
        fast.wait_ready()
        slow.wait_ready()
        both = {fast.peer_id, slow.peer_id}

        def paced_rounds(history):
            # rounds sealed with both anchors once a budget was set (the first rounds run H steps)
            return [e for e in history if set(e["contributors"]) == both and e["round"] > 0 and e["budget_s"]]

        history = swarm.wait_for_history(
            lambda h: len(paced_rounds(h)) >= 4, timeout=240, what="four paced rounds with both anchors"
        )
        paced = paced_rounds(history)
        for entry in paced:
            steps = entry["steps"]
            assert all(1 <= n <= 40 for n in steps.values()), entry
            assert steps[slow.peer_id] < steps[fast.peer_id], entry  # the same round, fewer steps
        # once both had trained, every seal had both: the slow one did not stretch a round nor miss one
        first = min(e["round"] for e in history if set(e["contributors"]) == both)
        later = [e for e in history if e["round"] > first]
        assert later and all(set(e["contributors"]) == both for e in later), later
        budgets = [e["budget_s"] for e in paced]
        assert all(0.5 <= b <= 600 for b in budgets), budgets

        document = swarm.wait_for(
            boot.maddr,
            lambda d: all(
                (p.get("params_round") or -1) >= paced[-1]["round"]
                for p in d["peers"]
                if p["name"] in ("fast", "slow")
            ),
            timeout=60,
            what="both anchors hold the last paced round",
        )
        swarm.agree_with_coordinator(document, {"fast", "slow"})

        # each announced the steps it took (its round log) and the seal carried them
        logged = {r["round"]: r["steps"] for r in read_rounds(swarm.tmp_path / "slow")}
        for entry in paced:
            if entry["round"] in logged:
                assert logged[entry["round"]] == entry["steps"][slow.peer_id], (entry, logged)
        # credit follows steps (up to H): the slow anchor's rows name its own steps
        for entry in paced:
            rows = entry["credits"]
            assert rows[slow.peer_id]["steps"] == entry["steps"][slow.peer_id]
            assert rows[fast.peer_id]["steps"] == min(entry["steps"][fast.peer_id], 20)
