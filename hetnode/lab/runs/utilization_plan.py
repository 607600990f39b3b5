"""What `hetnode bench utilization` runs (`hetnode/lab/runs/utilization.py`): the lab's hosts, links and CPU
shares, the rules compared, each run's config, and the plan; a plan that cannot measure what it says is
refused before anything starts."""

from __future__ import annotations

import os
from dataclasses import dataclass

from hetnode.config import Config, replace
from hetnode.errors import ConfigError, HetnodeError
from hetnode.lab.guard import check_chain_possible, check_roles_possible
from hetnode.lab.netlab.wan import LinkProfile

ANCHORS = ("anchor-1", "anchor-2", "anchor-3")
SLOW_ANCHOR = "anchor-3"  # held to `slow_anchor_share` of the others' CPU
STAGES = ("stage-1", "stage-2")
# label -> (outer.overlap, outer.schedule)
RULES = {
    "lockstep": (False, "steps"),
    "overlap": (True, "steps"),
    "paced": (False, "paced"),
    "paced+overlap": (True, "paced"),
}
NO_VERIFY_RULE = "overlap"  # the rule of the third run (verification off): the targets' configuration
# the soak's control-plane timings: heartbeats every 2 s cost five quota-bound daemons little CPU
LAB_NETWORK = {"heartbeat_s": 2.0, "record_ttl_s": 8.0, "stable_heartbeat_s": 8.0, "boundary_s": 4.0}
HEADROOM_CORES = 0.3  # left outside every quota: the WAN emulator, p2pd's start-up, this process


@dataclass(frozen=True)
class UtilizationPlan:
    # H, chosen so that a lockstep round spends 30-60 % of its wall time outside inner steps, as on slow
    # links. Measured here at H = 10 (tiny, batch 8 x 128, 0.3 of a core each, idle machine): an anchor's
    # 10 steps took 3.5 s and the rest of its round (announce, seal, fetch, apply, save) ~0.9 s, i.e.
    # 21 %; that rest does not shrink with H, so H = 5 puts it near 35-45 %. Each report checks the share
    # it measured (`H_check`).
    inner_steps: int = 5
    # paced: a replica's cap of inner steps a round, in H (max_inner_steps = cap_ratio × H). The slow anchor
    # needs ~9 fast steps for its one (0.25 of the share): at 2H the budget raised to its floor put the
    # fast anchors at their cap, waiting (utilisation 0.69-0.70, benchmarks/results/utilization-paced-3)
    cap_ratio: int = 4
    rules: tuple[str, ...] = tuple(RULES)  # which of RULES run, in this order
    # paced+overlap again at each of these caps (labelled `paced+overlap@<c>H`): the cap's trade of
    # tokens a second against loss per token, side by side in one run
    extra_caps: tuple[int, ...] = ()
    budget_s: float = 600.0  # per rule, from the first seal once every replica trained and synced a round
    no_verify_budget_s: float = 240.0
    warmup_rounds: int = 2  # after that start seal, before rounds are measured
    anchor_mbit: float = 50.0
    stage_mbit: float = 8.0
    rtt_ms: float = 40.0  # between any two hosts
    replica_cpu: float = 0.3  # of a core, each anchor and stage (its p2pd included)
    slow_anchor_share: float = 0.25  # the third anchor's CPU, of `replica_cpu`
    coordinator_cpu: float = 0.4
    batch_size: int = 8
    seq_len: int = 128
    start_timeout_s: float = 300.0  # from the daemons' READY until the anchors trained and synced a round
    chain_wait_s: float = 90.0  # then for the chain to, before the budget starts without it
    ready_timeout_s: float = 240.0  # per daemon, to its READY line (start-up under a quota is slow)


def plan_for(quick: bool) -> UtilizationPlan:
    # five swarms in about fifteen minutes on two cores: each ~40 s to its start seal, then its budget,
    # ~30 s to read the digests (not for the last) and 5 s to stop
    if quick:
        return UtilizationPlan(
            budget_s=120.0, no_verify_budget_s=40.0, start_timeout_s=180.0, chain_wait_s=30.0
        )
    return UtilizationPlan()


def check_plan(config: Config, plan: UtilizationPlan, cores: int | None = None) -> None:
    """Refuse a plan that cannot measure what it says, naming the flag or key and what would work."""
    check_roles_possible(
        lab_config(config, plan, overlap=False, verify=True),
        {a: ("anchor", plan.anchor_mbit) for a in ANCHORS} | {s: ("stage", plan.stage_mbit) for s in STAGES},
        "bench utilization",
    )
    check_chain_possible(replace(config, "pipeline", stages=len(STAGES)), len(STAGES), "bench utilization")
    if plan.inner_steps < 1:
        raise ConfigError("--inner-steps", "outer.inner_steps", f"must be at least 1, got {plan.inner_steps}")
    if plan.cap_ratio < 1 or any(c < 1 for c in plan.extra_caps):
        caps = ", ".join(str(c) for c in (plan.cap_ratio, *plan.extra_caps))
        raise ConfigError("--cap", "outer.max_inner_steps", f"must be at least 1 (× H), got {caps}")
    unknown = [label for label in plan.rules if label not in RULES]
    if unknown or not {"lockstep", "overlap"} <= set(plan.rules):
        raise ConfigError(
            "--rules",
            "bench utilization",
            f"got {','.join(plan.rules)}: choose from {','.join(RULES)}, lockstep and overlap included "
            "(every ratio is against them)",
        )
    if plan.budget_s < 30 or plan.no_verify_budget_s < 20:
        raise ConfigError(
            "--budget",
            "bench utilization",
            f"{plan.budget_s:g} s per rule ({plan.no_verify_budget_s:g} s without verification) leaves no "
            "measured rounds after the warm-up: use --budget 30 or more",
        )
    cores = cores or os.cpu_count() or 1
    wanted = sum(shares(plan).values())
    if wanted > cores - HEADROOM_CORES:
        raise HetnodeError(
            f"the quotas add up to {wanted:.2f} cores; this machine has {cores}, and "
            f"{HEADROOM_CORES:g} must stay free for the WAN emulator: lower the per-replica share"
        )


def lab_config(
    config: Config,
    plan: UtilizationPlan,
    overlap: bool,
    verify: bool,
    schedule: str = "steps",
    cap_ratio: int | None = None,
) -> Config:
    config = replace(config, "outer", inner_steps=plan.inner_steps, overlap=overlap, verify=verify)
    # paced: down to one step (the slow anchor's share of a round), up to cap_ratio × H
    config = replace(
        config,
        "outer",
        schedule=schedule,
        min_inner_steps=1,
        max_inner_steps=(cap_ratio or plan.cap_ratio) * plan.inner_steps,
    )
    config = replace(config, "pipeline", stages=len(STAGES))
    config = replace(config, "data", batch_size=plan.batch_size, seq_len=plan.seq_len)
    floor = plan.anchor_mbit / 2  # the anchors' 50 Mbit/s is an anchor's link here
    return replace(config, "network", anchor_min_up_mbps=floor, anchor_min_down_mbps=floor, **LAB_NETWORK)


def capped_label(cap: int) -> str:
    return f"paced+overlap@{cap}H"


def lab_links(plan: UtilizationPlan) -> dict[str, LinkProfile]:
    """Every host a quarter of the RTT from the core each way: any two hosts are `rtt_ms` apart."""
    delay = plan.rtt_ms / 4
    rates = {"coordinator": None} | dict.fromkeys(ANCHORS, plan.anchor_mbit)
    rates |= dict.fromkeys(STAGES, plan.stage_mbit)
    return {name: LinkProfile(down_mbit=r, up_mbit=r, delay_ms=delay) for name, r in rates.items()}


def shares(plan: UtilizationPlan) -> dict[str, float]:
    every = {"coordinator": plan.coordinator_cpu} | dict.fromkeys((*ANCHORS, *STAGES), plan.replica_cpu)
    return every | {SLOW_ANCHOR: plan.replica_cpu * plan.slow_anchor_share}
