"""What `hetnode bench chains` runs (`hetnode/lab/runs/chains.py`): the cases, each case's members and config,
the lab's links and CPU shares, and the plan; a plan that cannot measure what it says is refused before
anything starts.

The layout is fixed by advertised compute (`hetnode join --tflops`, hidden): the planner makes the fastest
candidate the first stage and splits the layers by compute, so stage-0 (2 TFLOP/s) leads and stage-1a /
stage-1b (1.9 / 1.8) hold the second stage, about half the layers each side; the first stage takes no pool,
so a third stage peer goes to the second stage's pool (`pipeline.stage_workers = 2`) or waits as a spare
(`stage_workers = 1`). The CPU quotas make the second stage the chain's bottleneck: stage-0 gets twice a
worker's share, so a second worker in the pool speeds the chain up."""

from __future__ import annotations

import os
from dataclasses import dataclass

from hetnode.config import Config, replace
from hetnode.errors import ConfigError, HetnodeError
from hetnode.lab.guard import check_chain_possible, check_roles_possible
from hetnode.lab.netlab.wan import LinkProfile
from hetnode.lab.runs.utilization_plan import HEADROOM_CORES, LAB_NETWORK
from hetnode.lab.swarm import Member

ANCHOR = "anchor"
FIRST = "stage-0"  # the chain's first stage: its round log is the chain's
SECOND = ("stage-1a", "stage-1b")  # the second stage's worker(s), or a worker and a spare
LIAR = "stage-1b"  # malicious_worker: this pool worker turns to sending gradients ×1000 upstream
TFLOPS = {FIRST: 2.0, "stage-1a": 1.9, "stage-1b": 1.8}  # advertised: who leads, how the layers split
STAGES = 2  # pipeline.stages
LIAR_FAULT = "grad-scaled"  # hetnode.daemon.faults: every gradient frame it sends upstream ×1000

# case -> (pipeline.stage_workers, its stage peers); every case also has the coordinator and the anchor
CASES: dict[str, tuple[int, tuple[str, ...]]] = {
    "one_worker": (1, (FIRST, SECOND[0])),
    "two_workers": (2, (FIRST, *SECOND)),
    "worker_killed": (2, (FIRST, *SECOND)),
    "spare": (1, (FIRST, *SECOND)),  # a chain of two and an idle spare
    "malicious_worker": (2, (FIRST, *SECOND)),
}


@dataclass(frozen=True)
class ChainsPlan:
    inner_steps: int = 5  # H: the chain feeds H micro-batches a round, the anchor trains H steps
    cases: tuple[str, ...] = tuple(CASES)  # which run, in this order (each a fresh swarm)
    batch_size: int = 8
    seq_len: int = 128
    anchor_mbit: float = 50.0
    stage_mbit: float = 8.0
    rtt_ms: float = 40.0  # between any two hosts
    # CPU, in cores (p2pd included). The second stage is the chain's bottleneck with one worker or two: a
    # worker has 0.4 of the first stage's share for the same half of the model. At 0.4 for the first stage
    # (twice a worker's) a pool of two made the first stage the bottleneck (its compute 70 % of its
    # round, its p2pd, frames and routing beside it) and the run measured the first stage: 1.65x
    # (benchmarks/results/chains-first-stage-0.4). The anchor gets the most: a round's budget is its pace
    coordinator_cpu: float = 0.3
    anchor_cpu: float = 0.5
    first_stage_cpu: float = 0.5
    worker_cpu: float = 0.2
    # paced rounds: at least round_s of training each (long beside the chain's few seconds of start-up and
    # catch-up under its quotas), up to max_micro_batches a round (above what either chain fits in round_s)
    verify: bool = False  # the coordinator's verifier on (`--verify`): its scores of the pool in the ledger
    round_s: float = 6.0
    max_micro_batches: int = 60
    warmup_rounds: int = 2  # after the first round sealed with the whole chain, before tokens/s is measured
    measure_s: float = 240.0  # one_worker, two_workers: seconds of rounds measured after the warm-up
    rounds_before_event: int = 4  # rounds sealed with the whole chain before a kill (the pre-kill rate)
    rounds_after_event: int = 6  # rounds sealed with the chain once it is back (figures need a few)
    fault_after_s: float = 120.0  # malicious_worker: the liar turns this long after its daemon starts
    recover_share: float = 0.9  # worker_killed: recovered at this share of the one-worker rate
    status_poll_s: float = 2.0  # malicious_worker: how often the coordinator's status is read for the blame
    start_timeout_s: float = 300.0  # from every READY until a round is sealed with the case's whole chain
    event_timeout_s: float = 240.0  # after a kill or a fault, for the chain to be back (or the liar caught)
    ready_timeout_s: float = 240.0  # per daemon, to its READY line (start-up under a quota is slow)


def plan_for(quick: bool) -> ChainsPlan:
    # five swarms in about ten minutes on two cores: each ~45 s from the lab to a round sealed with the whole
    # chain (a pool's second worker joins at a later boundary), then its case, ~5 s to read the digests and
    # 5 s to stop. The liar turns 80 s after its daemon starts: ~35 s of start-up, the chain, its growth
    # and a few rounds with both workers.
    if quick:
        return ChainsPlan(
            warmup_rounds=1,
            measure_s=30.0,
            rounds_before_event=3,
            rounds_after_event=3,
            fault_after_s=80.0,
            start_timeout_s=150.0,
            event_timeout_s=90.0,
        )
    return ChainsPlan()


def check_plan(config: Config, plan: ChainsPlan, cores: int | None = None) -> None:
    """Refuse a plan that cannot measure what it says, naming the flag or key and what would work."""
    unknown = [case for case in plan.cases if case not in CASES]
    if unknown or not plan.cases:
        raise ConfigError(
            "--cases", "bench chains", f"got {','.join(plan.cases) or 'none'}: choose from {','.join(CASES)}"
        )
    if plan.inner_steps < 1:
        raise ConfigError("--inner-steps", "outer.inner_steps", f"must be at least 1, got {plan.inner_steps}")
    lab = lab_config(config, plan, stage_workers=2)
    declared = {ANCHOR: ("anchor", plan.anchor_mbit)} | {s: ("stage", plan.stage_mbit) for s in TFLOPS}
    check_roles_possible(lab, declared, "bench chains")
    check_chain_possible(lab, STAGES, "bench chains")
    if plan.measure_s < 20:
        raise ConfigError(
            "--measure",
            "bench chains",
            f"{plan.measure_s:g} s leaves no measured rounds after the warm-up: use --measure 20 or more",
        )
    if plan.fault_after_s <= 0:
        raise ConfigError(
            "--fault-after",
            "bench chains",
            f"must be above 0 s (the liar is honest first), got {plan.fault_after_s:g}",
        )
    if plan.worker_cpu >= plan.first_stage_cpu:
        raise HetnodeError(
            f"a second-stage worker's CPU share ({plan.worker_cpu:g}) is not below the first stage's "
            f"({plan.first_stage_cpu:g}): the second stage would not hold the chain back, and a pool would "
            "measure nothing; give the workers less"
        )
    cores = cores or os.cpu_count() or 1
    wanted = max(sum(shares(plan, case).values()) for case in plan.cases)
    if wanted > cores - HEADROOM_CORES + 1e-9:
        raise HetnodeError(
            f"the quotas add up to {wanted:.2f} cores; this machine has {cores}, and "
            f"{HEADROOM_CORES:g} must stay free for the WAN emulator: lower the shares"
        )


def lab_config(config: Config, plan: ChainsPlan, stage_workers: int) -> Config:
    """Paced, overlapped rounds of at least `round_s`, without the verifier unless `verify` (what is measured
    is the chain's rounds, not its scores: a verifier that leaves a chain's work out would read as rounds
    lost), two stages, `stage_workers` per stage, the lab's control-plane timings.

    Paced, so that a round's length is a budget and the chain feeds as many micro-batches as fit in it: a
    pool shows as more micro-batches a round. Lockstep rounds of H did not measure the chain at all: the
    anchor's round (about 1 s) was shorter than the chain's start-up and catch-up under its quotas, so the
    chain never held the round before in time for a seal to wait for it (measured: 30 rounds sealed with the
    anchor alone, in lockstep and overlapped)."""
    config = replace(
        config,
        "outer",
        inner_steps=plan.inner_steps,
        overlap=True,
        verify=plan.verify,
        schedule="paced",
        min_round_s=plan.round_s,
        max_inner_steps=plan.max_micro_batches,
    )
    config = replace(config, "pipeline", stages=STAGES, stage_workers=stage_workers)
    config = replace(config, "data", batch_size=plan.batch_size, seq_len=plan.seq_len)
    floor = plan.anchor_mbit / 2  # the 50 Mbit/s anchor is an anchor here
    return replace(config, "network", anchor_min_up_mbps=floor, anchor_min_down_mbps=floor, **LAB_NETWORK)


def case_config(config: Config, plan: ChainsPlan, case: str) -> Config:
    return lab_config(config, plan, stage_workers=CASES[case][0])


def members(plan: ChainsPlan, case: str) -> list[Member]:
    """The anchor, then the case's stage peers, each advertising its compute; the liar with its fault."""
    out = [Member(ANCHOR, "anchor", plan.anchor_mbit)]
    for name in CASES[case][1]:
        extra = ("--tflops", f"{TFLOPS[name]:g}")
        if case == "malicious_worker" and name == LIAR:
            extra += ("--fault", LIAR_FAULT, "--fault-after", f"{plan.fault_after_s:g}")
        out.append(Member(name, "stage", plan.stage_mbit, extra))
    return out


def lab_links(plan: ChainsPlan, case: str) -> dict[str, LinkProfile]:
    """Every host a quarter of the RTT from the core each way: any two hosts are `rtt_ms` apart."""
    delay = plan.rtt_ms / 4
    rates = {"coordinator": None, ANCHOR: plan.anchor_mbit} | dict.fromkeys(CASES[case][1], plan.stage_mbit)
    return {name: LinkProfile(down_mbit=r, up_mbit=r, delay_ms=delay) for name, r in rates.items()}


def shares(plan: ChainsPlan, case: str) -> dict[str, float]:
    stages = {name: plan.first_stage_cpu if name == FIRST else plan.worker_cpu for name in CASES[case][1]}
    return {"coordinator": plan.coordinator_cpu, ANCHOR: plan.anchor_cpu} | stages
