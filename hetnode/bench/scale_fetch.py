"""The sealed fetch as the daemon schedules it, for `hetnode bench scale`'s `any-holder` rows (docs/scale.md).

The fluid `any-holder` schedule (`scale_schedules.py`) lets every author serve all of its fetchers at once:
the balanced limit of the implemented schedule. `fetch_sealed` in `hetnode/daemon/payload_fetch.py` does
less than that:
- a fetcher asks at most MAX_PARALLEL_HOLDERS holders at a time, in the order their payloads appear in the
  seal (`next_requests` keeps it), which is the same order for every fetcher;
- it gives a holder HOLDER_TIMEOUT_S + PER_PAYLOAD_S per payload (shard) asked for, and passes over one
  that is slower: those payloads go to their next candidate, which at seal time is the sealer (nobody has
  applied the round yet), asked once every first request has ended.

Fetchers of one class (the anchors; stage s of every chain) hold the same list in the same order and see
the seal together, so they move in lockstep: one representative per class, each author a group of its own
(its uplink), rates shared max-min fairly per connection (`fluid.fair_rates`). The seal's order is the
order announcements arrived in: a fixed shuffle of anchors and stages here.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, field

from hetnode.bench.fluid import NodeGroup, Transfer, fair_rates
from hetnode.bench.scale_schedules import MBIT, Links, Swarm
from hetnode.bench.scale_sizes import PayloadSizes
from hetnode.planning.fetch import MAX_PARALLEL_HOLDERS, STALL_TIMEOUT_S

SEAL_ORDER_SEED = 0


@dataclass
class _Request:
    name: str
    fetchers: str  # the class's group
    holder: str  # an author's group, or "coordinator"
    per_fetcher: float  # bytes one fetcher of the class wants from it
    flows: int  # fetchers of the class that want it (an author does not fetch its own)
    payloads: int  # shards asked for in the one batch
    slot_s: float = math.inf  # it took one of the class's slots
    left: float = 0.0  # bytes over all flows
    sent: float = 0.0
    done: bool = False

    @property
    def deadline_s(self) -> float:
        return self.slot_s + STALL_TIMEOUT_S * self.payloads  # each shard within the stall timeout (lockstep)


@dataclass
class DaemonFetch:
    """The post-seal fetch of every class, from the first request to the last byte."""

    fetch_s: dict[str, float]  # per class: until its last payload arrived
    requests: int
    timed_out: int  # requests passed over for being slower than their timeout
    fallback_bytes: float  # what the sealer sent to fetchers that passed an author over
    wasted_bytes: dict[str, float]  # per class: bytes received for requests that then timed out
    failed: bool  # a request to the sealer timed out too: the round cannot be applied that way
    holder_upload_bytes: dict[str, float] = field(default_factory=dict)

    @property
    def makespan_s(self) -> float:
        return max(self.fetch_s.values(), default=0.0)


def _authors(swarm: Swarm, seed: int) -> list[int | None]:
    """The seal's contributions in order: None for an anchor, s for a chain's stage s."""
    authors: list[int | None] = [None] * swarm.anchors
    authors += [s for _ in range(swarm.chains) for s in range(swarm.stages)]
    random.Random(seed).shuffle(authors)
    return authors


def _requests(sizes: PayloadSizes, swarm: Swarm, seed: int) -> dict[str, list[_Request]]:
    """Per class, its first requests in the seal's order: one batch per author."""
    a, c, p = swarm.anchors, swarm.chains, sizes.payload_bytes
    everything = len(sizes.shard_bytes)
    classes: dict[str, list[_Request]] = {"anchors": []}
    for s in range(swarm.stages) if c else ():
        classes[f"stage{s}"] = []
    for j, stage in enumerate(_authors(swarm, seed)):
        holder = f"author{j}"
        if stage is None:
            wants = [("anchors", p, everything, a - 1)]
            wants += [
                (f"stage{s}", sizes.stage_bytes(s), len(sizes.stage_shards[s]), c)
                for s in range(swarm.stages)
            ]
        else:
            ps, shards = sizes.stage_bytes(stage), len(sizes.stage_shards[stage])
            wants = [("anchors", ps, shards, a), (f"stage{stage}", ps, shards, c - 1)]
        for cls, nbytes, payloads, flows in wants:
            if flows > 0 and cls in classes:
                classes[cls].append(_Request(f"{cls}<-{holder}", cls, holder, nbytes, flows, payloads))
    return classes


def daemon_fetch(sizes: PayloadSizes, swarm: Swarm, links: Links, seed: int = SEAL_ORDER_SEED) -> DaemonFetch:
    """Every class's fetch of the sealed payloads, from t = 0 (the fetchers read the seal) to the end."""
    groups = {"coordinator": NodeGroup("coordinator", 1, links.coordinator_mbit * MBIT, 0.0)}
    for j, stage in enumerate(_authors(swarm, seed)):
        rate = (links.anchor_mbit if stage is None else links.stage_mbit) * MBIT
        groups[f"author{j}"] = NodeGroup(f"author{j}", 1, rate, 0.0)
    queues = _requests(sizes, swarm, seed)
    for cls, count, mbit in [("anchors", swarm.anchors, links.anchor_mbit)] + [
        (f"stage{s}", swarm.chains, links.stage_mbit) for s in range(swarm.stages) if swarm.chains
    ]:
        groups[cls] = NodeGroup(cls, count, 0.0, mbit * MBIT)
    requests = sum(len(q) for q in queues.values())
    pending = {cls: list(q) for cls, q in queues.items()}
    fallback: dict[str, list[_Request]] = {cls: [] for cls in queues}
    asked_sealer: set[str] = set()
    slots = dict.fromkeys(queues, MAX_PARALLEL_HOLDERS)
    active: list[_Request] = []
    finished = {cls: 0.0 for cls in queues}
    uploads: dict[str, float] = {}
    wasted = dict.fromkeys(queues, 0.0)
    timed_out, failed, now = 0, False, 0.0
    rtt = links.rtt_s
    while True:
        for cls in queues:  # take free slots in order; the sealer once every first request has ended
            while slots[cls] and pending[cls]:
                request = pending[cls].pop(0)
                request.slot_s, request.left = now, request.per_fetcher * request.flows
                slots[cls] -= 1
                active.append(request)
            first_done = not pending[cls] and not any(r.fetchers == cls for r in active)
            if first_done and fallback[cls] and cls not in asked_sealer:
                asked_sealer.add(cls)
                lost = fallback[cls]
                count = groups[cls].count
                per_fetcher = sum(r.per_fetcher * r.flows for r in lost) / count
                batch = _Request(
                    f"{cls}<-sealer", cls, "coordinator", per_fetcher, count, sum(r.payloads for r in lost)
                )
                batch.slot_s, batch.left = now, per_fetcher * count
                slots[cls] -= 1
                active.append(batch)
        if not active:
            break
        # bytes flow one RTT after a request took its slot (the stream's request)
        flowing = [r for r in active if r.slot_s + rtt <= now]
        rates = fair_rates(groups, [Transfer(r.name, r.holder, r.fetchers, r.left, r.flows) for r in flowing])
        events = [r.slot_s + rtt for r in active if r.slot_s + rtt > now]
        events += [r.deadline_s for r in active]
        events += [now + r.left / rates[r.name] for r in flowing if rates[r.name] > 0]
        step = min(events) - now
        for r in flowing:
            moved = min(r.left, rates[r.name] * step)
            r.left -= moved
            r.sent += moved
            uploads[r.holder] = uploads.get(r.holder, 0.0) + moved
            if r.left <= 1e-9 * r.per_fetcher * r.flows + 1e-6:
                r.done = True
        now += step
        for r in [r for r in active if r.done or r.deadline_s <= now]:
            active.remove(r)
            slots[r.fetchers] += 1
            if r.done:
                finished[r.fetchers] = now
            elif r.holder == "coordinator":
                failed = True
            else:
                timed_out += 1
                wasted[r.fetchers] += r.sent
                fallback[r.fetchers].append(r)
    return DaemonFetch(
        fetch_s=finished,
        requests=requests,
        timed_out=timed_out,
        fallback_bytes=uploads.get("coordinator", 0.0),
        wasted_bytes=wasted,
        failed=failed,
        holder_upload_bytes=uploads,
    )
