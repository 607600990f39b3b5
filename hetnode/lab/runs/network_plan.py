"""What `hetnode bench network` runs (`hetnode/lab/runs/network.py`): the lab's hosts and links, its daemons'
timings, and the plan of rounds; a plan that cannot form its chain is refused before anything starts."""

from __future__ import annotations

from dataclasses import dataclass

from hetnode.config import Config
from hetnode.errors import HetnodeError
from hetnode.lab.guard import check_chain_possible, check_roles_possible

ANCHORS = ("anchor-1", "anchor-2")
STAGES = ("stage-1", "stage-2")
# One machine: the DHT answers in milliseconds, so boundaries can be short; heartbeats stay a few seconds
# apart so that the control plane's bytes (records, polls) stay small next to a round's payloads.
# the daemon-overhead run: the anchor on core 0 (as `hetnode train` is measured), the coordinator on core 1,
# as on two machines: its evaluation after each round then takes nothing from the anchor's training
SOLO_CORES = {"anchor-1": "0", "coordinator": "1"}
LAB_TIMINGS = {"heartbeat_s": 2.0, "record_ttl_s": 8.0, "boundary_s": 4.0, "confirm_s": 2.0}
ANCHOR_MBIT = 1000.0  # what the anchors declare (their links are not shaped)


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


def lab_rates(
    plan: NetworkPlan, anchors: tuple[str, ...] = ANCHORS, stages: tuple[str, ...] = STAGES
) -> dict[str, float | None]:
    return {"coordinator": None, **{a: None for a in anchors}, **{s: plan.slow_mbit for s in stages}}
