"""What a soak run does (`SoakPlan`), apart from the lab that runs it (`soak.py`), so that `hetnode bench
soak --help` can show the defaults without loading the lab and matplotlib."""

from __future__ import annotations

from dataclasses import dataclass

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
