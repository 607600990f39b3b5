"""What a soak run does (`SoakPlan`, its churn schedule, the config its daemons run), apart from the lab that
runs it (`soak.py`) and its report (`soak_report.py`), so that `hetnode bench soak --help` can show the
defaults without loading the lab and matplotlib."""

from __future__ import annotations

from dataclasses import dataclass

from hetnode.config import Config, replace
from hetnode.errors import HetnodeError
from hetnode.lab.netlab.wan import LinkProfile, link_profile


@dataclass(frozen=True)
class SoakPlan:
    minutes: float = 60.0
    anchors: int = 3  # anchor-1.. ; one more joins during the run
    stage_peers: int = 3  # a chain of `stages` and spares that re-form it when a member dies
    stages: int = 2
    anchor_mbit: float = 100.0
    stage_mbit: float = 20.0
    inner_steps: int = 10
    batch_size: int = 4
    seq_len: int = 64
    sample_every_s: float = 60.0
    # hosts on WAN links (hetnode.lab.netlab.wan presets); the others are LAN links at their class's rate. The
    # late anchor is on another continent (150 ms RTT, no other churn: its rounds are compared with the
    # LAN anchors'); a spare stage is on an asymmetric home link.
    wan: tuple[tuple[str, str], ...] = (("anchor-4", "far-fast"), ("stage-3", "home-cable"))
    warmup_s: float = 180.0  # of each daemon's life, before its RSS and fds count toward a slope

    def profile(self, name: str) -> LinkProfile:
        """The link of lab host `name`."""
        wan = dict(self.wan)
        if name in wan:
            return link_profile(wan[name])
        if name == "coordinator":
            return link_profile(None)
        return link_profile(self.stage_mbit if name.startswith("stage") else self.anchor_mbit)

    def names(self) -> tuple[list[str], list[str]]:
        return [f"anchor-{i + 1}" for i in range(self.anchors)], [
            f"stage-{i + 1}" for i in range(self.stage_peers)
        ]


LINK_DOWN_S = 30.0
NAT_ANCHOR, NAT_ROUTER = "anchor-nat", "home"  # a volunteer behind a masquerading home router
LAB_NETWORK = {"heartbeat_s": 2.0, "record_ttl_s": 8.0, "stable_heartbeat_s": 8.0, "boundary_s": 4.0}


@dataclass(frozen=True)
class ChurnEvent:
    at_share: float  # of the run
    kind: str  # join, leave, crash, restart, link-down, chain-member-dies, coordinator-restart
    target: str


def churn_schedule(plan: SoakPlan) -> list[ChurnEvent]:
    """The events, in order. Every kind the issue names happens once; the peers that left come back, so that
    their catch-up is measured."""
    anchors, _ = plan.names()
    late = f"anchor-{plan.anchors + 1}"
    return [
        ChurnEvent(0.10, "join", late),
        ChurnEvent(0.18, "leave", anchors[1]),
        ChurnEvent(0.26, "restart", anchors[1]),
        ChurnEvent(0.34, "crash", anchors[2]),
        ChurnEvent(0.42, "restart", anchors[2]),
        ChurnEvent(0.50, "link-down", anchors[0]),
        ChurnEvent(0.60, "chain-member-dies", "live stage"),
        ChurnEvent(0.70, "coordinator-restart", "coordinator"),
        ChurnEvent(0.80, "restart", "dead stage"),
    ]


def validate(plan: SoakPlan) -> None:
    """Refuse a plan that cannot show what the soak measures."""
    if plan.anchors < 3:
        raise HetnodeError(
            "bench soak needs --anchors 3 or more: one leaves, one crashes, one loses its link"
        )
    if plan.stage_peers < plan.stages + 1:
        raise HetnodeError(
            f"bench soak needs {plan.stages + 1} stage peers: a chain and a spare to re-form it"
        )
    if plan.minutes * 60 * 0.08 < LINK_DOWN_S:
        raise HetnodeError(
            f"--minutes {plan.minutes:g} is too short: events are 8 % of the run apart and a "
            f"link stays down {LINK_DOWN_S:g} s (use --minutes 7 or more)"
        )
    anchors, stages = plan.names()
    hosts = {"coordinator", *anchors, f"anchor-{plan.anchors + 1}", NAT_ROUTER, *stages}
    unknown = sorted({host for host, _ in plan.wan} - hosts)
    if unknown:
        raise HetnodeError(f"--wan names no lab host: {unknown}; the hosts are {', '.join(sorted(hosts))}")


def lab_config(config: Config, plan: SoakPlan) -> Config:
    config = replace(config, "outer", inner_steps=plan.inner_steps, verify=False)
    config = replace(config, "pipeline", stages=plan.stages)
    config = replace(config, "data", batch_size=plan.batch_size, seq_len=plan.seq_len)
    floor = plan.anchor_mbit / 2
    return replace(config, "network", anchor_min_up_mbps=floor, anchor_min_down_mbps=floor, **LAB_NETWORK)
