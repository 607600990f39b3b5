"""A flow-level (fluid) discrete-event model of bulk transfers between groups of identical peers.

Used by `hetnode bench scale` (docs/scale.md). A `NodeGroup` is a set of peers that play the same part
(e.g. "the anchors", "stage 1 of every chain"), each with its own upload and download rate. A `Transfer`
moves bytes from one group to another over `flows` connections spread evenly over the source and the
destination peers; it starts `delay_s` after every transfer it waits for has finished.

Between events the rates are constant: per-connection max-min fair sharing (what TCP approximates) of each
peer's uplink and downlink, computed by progressive filling. Events are transfers starting or finishing,
so a round costs a few dozen allocations whatever the number of peers. Because a transfer's flows are
spread evenly over its groups, every peer of a group carries the same load: the model describes the
balanced schedule, not the luck of a hash.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

Link = tuple[str, str]  # (group, "up" | "down")


@dataclass(frozen=True)
class NodeGroup:
    name: str
    count: int
    up_bytes_s: float  # each peer's
    down_bytes_s: float

    def capacity(self, direction: str) -> float:
        return self.up_bytes_s if direction == "up" else self.down_bytes_s


@dataclass(frozen=True)
class Transfer:
    name: str
    src: str
    dst: str
    nbytes: float  # over all its flows
    flows: int  # connections, spread evenly over the peers of src and of dst
    after: tuple[str, ...] = ()
    delay_s: float = 0.0  # from the last of `after` finishing to the first byte (a request, a nudge)


@dataclass(frozen=True)
class Timeline:
    start_s: dict[str, float]  # first byte
    finish_s: dict[str, float]

    @property
    def makespan_s(self) -> float:
        return max(self.finish_s.values(), default=0.0)


def link_seconds(groups: Mapping[str, NodeGroup], transfers: Sequence[Transfer]) -> dict[Link, float]:
    """Per link: the bytes one peer of the group carries over all transfers, over its rate. The largest is
    the round's physical limit: no schedule of these transfers can finish sooner."""
    load: dict[Link, float] = {}
    for t in transfers:
        for group, direction in ((t.src, "up"), (t.dst, "down")):
            g = groups[group]
            load[(group, direction)] = load.get((group, direction), 0.0) + t.nbytes / g.count
    return {link: b / groups[link[0]].capacity(link[1]) for link, b in load.items() if b > 0}


def fair_rates(groups: Mapping[str, NodeGroup], active: Sequence[Transfer]) -> dict[str, float]:
    """Aggregate bytes/s of each active transfer under per-connection max-min fairness."""
    # a transfer puts flows/count connections on each peer of its source (up) and destination (down)
    weights: dict[Link, dict[str, float]] = {}
    for t in active:
        weights.setdefault((t.src, "up"), {})[t.name] = t.flows / groups[t.src].count
        weights.setdefault((t.dst, "down"), {})[t.name] = t.flows / groups[t.dst].count
    slack = {link: groups[link[0]].capacity(link[1]) for link in weights}
    per_flow = {t.name: 0.0 for t in active}
    frozen: set[str] = set()
    while len(frozen) < len(per_flow):
        # raise every unfrozen flow equally until the first link fills up
        step, full = math.inf, None
        for link, w in weights.items():
            load = sum(v for name, v in w.items() if name not in frozen)
            if load > 0 and slack[link] / load < step:
                step, full = slack[link] / load, link
        if full is None:
            raise ValueError("a transfer uses no link")
        for link, w in weights.items():
            slack[link] -= step * sum(v for name, v in w.items() if name not in frozen)
        for name in per_flow:
            if name not in frozen:
                per_flow[name] += step
        frozen.update(weights[full])
    return {t.name: per_flow[t.name] * t.flows for t in active}


def simulate(groups: Mapping[str, NodeGroup], transfers: Sequence[Transfer]) -> Timeline:
    """Run the transfers to completion; every transfer's start and finish time."""
    by_name = {t.name: t for t in transfers}
    if len(by_name) != len(transfers):
        raise ValueError("transfer names must be unique")
    for t in transfers:
        missing = [d for d in t.after if d not in by_name]
        if missing or t.src not in groups or t.dst not in groups:
            raise ValueError(f"transfer {t.name!r} names unknown transfers or groups: {missing}")
    start: dict[str, float] = {}
    finish: dict[str, float] = {}
    left = {t.name: float(t.nbytes) for t in transfers}
    now = 0.0
    while len(finish) < len(transfers):
        changed = True
        while changed:  # a milestone finishing now may let others start now
            changed = False
            for t in transfers:
                if t.name not in start and all(d in finish for d in t.after):
                    start[t.name] = max((finish[d] for d in t.after), default=0.0) + t.delay_s
                    changed = True
            for name, at in start.items():  # empty transfers (milestones) finish on arrival
                if name not in finish and at <= now and left[name] <= 0:
                    finish[name] = at
                    changed = True
        if len(finish) == len(transfers):
            break
        active = [t for t in transfers if t.name not in finish and start.get(t.name, math.inf) <= now]
        rates = fair_rates(groups, active) if active else {}
        arrivals = [at for name, at in start.items() if name not in finish and at > now]
        ends = [now + left[name] / rate for name, rate in rates.items() if rate > 0]
        if not arrivals and not ends:
            raise ValueError("transfers wait on each other in a cycle")
        nxt = min(arrivals + ends)
        for name, rate in rates.items():
            left[name] -= rate * (nxt - now)
            # bytes left below a millionth of a byte per byte moved are rounding, not work
            if left[name] <= 1e-9 * by_name[name].nbytes + 1e-6:
                left[name] = 0.0
                finish[name] = nxt
        now = nxt
    return Timeline(start, finish)
