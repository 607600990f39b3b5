"""One sync round's transfers per mode, for `hetnode bench scale` (docs/scale.md).

Each schedule is a list of `fluid.Transfer`s between groups of peers that play the same part: the
coordinator, the anchors, and stage s of every chain. Every mode starts with the coordinator fetching each
payload once, from its author, to validate it (`hetnode/protocol/payload_checks.py`), then seals.
- `hub`: the code before b80d0c7. Every replica fetched every sealed payload of the shards it holds from
  the coordinator.
- `any-holder`: the code since b80d0c7 (`hetnode/planning/fetch.py`, `hetnode/daemon/payload_fetch.py`).
  At seal time the only holders are the authors, so each author serves its payload (a stage: its slice)
  to every replica that holds those shards; the coordinator serves only seals, and is the fallback.
- `seeded`: a planned improvement. A stage uploads its payload once, to a seed anchor; the coordinator
  validates it from there, and stages fetch from anchors only.
- `tiles`: the planned step past the crossover R*: reduce-scatter to anchors, all-gather of a dense
  aggregate.
"""

from __future__ import annotations

from dataclasses import dataclass

from hetnode.lab.scale.fluid import NodeGroup, Transfer
from hetnode.lab.scale.sizes import DENSE_AGGREGATE_BYTES_PER_PARAM, PayloadSizes, seal_bytes

MODES = ("hub", "any-holder", "seeded", "tiles")
MBIT = 1e6 / 8  # bytes/s
# names of the transfers that bring a replica what it applies after the seal
SEALED_DOWNLOADS = ("seal:", "fetch:", "gather:")


@dataclass(frozen=True)
class Links:
    anchor_mbit: float = 1000.0  # up and down
    stage_mbit: float = 20.0
    coordinator_mbit: float = 1000.0
    rtt_s: float = 0.05


@dataclass(frozen=True)
class Swarm:
    anchors: int
    chains: int
    stages: int  # per chain

    @property
    def replicas(self) -> int:
        return self.anchors + self.chains

    @property
    def peers(self) -> int:
        """Everyone in the DHT: anchors, every chain's stages, the coordinator."""
        return self.anchors + self.chains * self.stages + 1


def swarm_at(replicas: int, stages: int, anchor_share: float) -> Swarm:
    """R replicas: round(share·R) anchors (at least one: they carry the seeded backbone), the rest chains
    of `stages` stages."""
    anchors = min(replicas, max(1, round(anchor_share * replicas)))
    return Swarm(anchors, replicas - anchors, stages)


def groups_of(swarm: Swarm, links: Links) -> dict[str, NodeGroup]:
    c = swarm.chains
    groups = {
        "coordinator": NodeGroup(
            "coordinator", 1, links.coordinator_mbit * MBIT, links.coordinator_mbit * MBIT
        ),
        "anchors": NodeGroup("anchors", swarm.anchors, links.anchor_mbit * MBIT, links.anchor_mbit * MBIT),
    }
    for s in range(swarm.stages) if c else ():
        groups[f"stage{s}"] = NodeGroup(f"stage{s}", c, links.stage_mbit * MBIT, links.stage_mbit * MBIT)
    return groups


def schedule(
    mode: str,
    sizes: PayloadSizes,
    swarm: Swarm,
    links: Links,
    prefetch: bool = False,
    drop_tail: bool = False,
) -> tuple[dict[str, NodeGroup], list[Transfer]]:
    """One round's groups of peers and transfers in `mode`, every replica having announced at t = 0.

    Every fetch starts one RTT after what it waits for (the request); the seal reaches peers half an RTT
    after the coordinator has validated the last payload (a nudge). CPU time (decode, check, aggregate) is
    left out: this is the network's share of a round. With `prefetch` (any-holder and seeded; the code has
    none), replicas fetch what was announced without waiting for the seal, which still gates applying.

    With `drop_tail` (any-holder), links do not share fairly: while the anchors' downlinks are full of each
    other's payloads, the stages' flows into them are starved and start only when that exchange ends (TCP on
    drop-tail queues, as the lab's link trace shows: docs/scale.md, "Link-bound runs")."""
    a, rtt = swarm.anchors, links.rtt_s
    out = [Transfer("validate:anchors", "anchors", "coordinator", a * sizes.payload_bytes, a, delay_s=rtt)]
    if mode == "hub":
        out += _hub(sizes, swarm, rtt)
    elif mode == "any-holder":
        out += _any_holder(sizes, swarm, rtt, prefetch, drop_tail)
    elif mode == "seeded":
        out += _seeded(sizes, swarm, rtt, prefetch)
    elif mode == "tiles":
        out += _tiles(sizes, swarm, rtt)
    else:
        raise ValueError(f"unknown mode {mode!r}; expected one of {MODES}")
    return groups_of(swarm, links), out


def _stages(swarm: Swarm) -> range:
    return range(swarm.stages) if swarm.chains else range(0)


def _seal(before: list[Transfer], rtt: float) -> Transfer:
    """The seal: once the coordinator has checked the anchors' payloads and the stages' in `before`."""
    validated = ("validate:anchors", *(t.name for t in before if t.name.startswith("validate:")))
    return Transfer("seal", "coordinator", "coordinator", 0, 1, validated, rtt / 2)


def _validate_from_authors(sizes: PayloadSizes, swarm: Swarm, rtt: float) -> list[Transfer]:
    c = swarm.chains
    return [
        Transfer(f"validate:stage{s}", f"stage{s}", "coordinator", c * sizes.stage_bytes(s), c, delay_s=rtt)
        for s in _stages(swarm)
    ]


def _hub(sizes: PayloadSizes, swarm: Swarm, rtt: float) -> list[Transfer]:
    a, c, r, p = swarm.anchors, swarm.chains, swarm.replicas, sizes.payload_bytes
    seal = seal_bytes(sizes, a, c)
    out = _validate_from_authors(sizes, swarm, rtt)
    out.append(_seal(out, rtt))
    # every replica fetches the sealed payloads of the shards it holds, but its own, from the coordinator
    out.append(
        Transfer("fetch:anchors", "coordinator", "anchors", a * ((r - 1) * p + seal), a, ("seal",), rtt)
    )
    for s in _stages(swarm):
        nbytes = c * ((r - 1) * sizes.stage_bytes(s) + seal)
        out.append(Transfer(f"fetch:stage{s}", "coordinator", f"stage{s}", nbytes, c, ("seal",), rtt))
    return out


def _any_holder(
    sizes: PayloadSizes, swarm: Swarm, rtt: float, prefetch: bool, drop_tail: bool = False
) -> list[Transfer]:
    """What `RoundParticipant.apply` does in a fault-free round: the seal is read from the coordinator,
    then each sealed payload comes from its author, the only holder at seal time (a replica lists others
    once their records say they applied the round: too late for fetchers that all start at the seal)."""
    a, c, p = swarm.anchors, swarm.chains, sizes.payload_bytes
    seal = seal_bytes(sizes, a, c)
    out = _validate_from_authors(sizes, swarm, rtt)
    out.append(_seal(out, rtt))
    out.append(Transfer("seal:anchors", "coordinator", "anchors", a * seal, a, ("seal",), rtt))
    for s in _stages(swarm):
        out.append(Transfer(f"seal:stage{s}", "coordinator", f"stage{s}", c * seal, c, ("seal",), rtt))

    def after(group: str) -> tuple[str, ...]:
        return () if prefetch else (f"seal:{group}",)

    if a > 1:
        flows = a * (a - 1)
        out.append(
            Transfer("fetch:anchors<-anchors", "anchors", "anchors", flows * p, flows, after("anchors"), rtt)
        )
    # starved while the anchors' exchange fills their downlinks (drop-tail), or alongside it (fair)
    starved = ("fetch:anchors<-anchors",) if drop_tail and a > 1 else ()
    for s in _stages(swarm):
        ps, stage = sizes.stage_bytes(s), f"stage{s}"
        # an anchor holds every shard: it fetches slice s from every stage-s author
        waits = after("anchors") + starved
        out.append(Transfer(f"fetch:anchors<-{stage}", stage, "anchors", a * c * ps, a * c, waits, rtt))
        # stage s fetches its slice from every anchor and from stage s of every other chain
        out.append(
            Transfer(f"fetch:{stage}<-anchors", "anchors", stage, c * a * ps, c * a, after(stage), rtt)
        )
        if c > 1:
            flows = c * (c - 1)
            out.append(
                Transfer(f"fetch:{stage}<-{stage}", stage, stage, flows * ps, flows, after(stage), rtt)
            )
    return out


def _seeded(sizes: PayloadSizes, swarm: Swarm, rtt: float, prefetch: bool) -> list[Transfer]:
    a, c, p = swarm.anchors, swarm.chains, sizes.payload_bytes
    seal = seal_bytes(sizes, a, c)
    out = []
    for s in _stages(swarm):
        ps = sizes.stage_bytes(s)
        # a stage uploads its payload once, to a seed anchor (spread evenly), as soon as it announces; the
        # coordinator validates it from there: a stage's slow uplink never carries a payload twice
        out.append(Transfer(f"seed:stage{s}", f"stage{s}", "anchors", c * ps, c, delay_s=rtt))
        seeded = (f"seed:stage{s}",)
        out.append(Transfer(f"validate:stage{s}", "anchors", "coordinator", c * ps, c, seeded, rtt))
    out.append(_seal(out, rtt))
    # the coordinator pushes the seal to the anchors with its nudge; stages get it with their first payload
    out.append(Transfer("seal:anchors", "coordinator", "anchors", a * seal, a, ("seal",)))
    sealed = ("seal:anchors",)
    seeds = tuple(f"seed:stage{s}" for s in _stages(swarm))
    if a > 1:  # anchors fetch the other anchors' payloads from their authors, the stages' from the seeds
        after = () if prefetch else sealed
        flows = a * (a - 1)
        out.append(Transfer("fetch:anchors<-anchors", "anchors", "anchors", flows * p, flows, after, rtt))
        if c:  # each anchor already holds the 1/a of the stage-authored bytes it seeded
            after = seeds if prefetch else sealed
            out.append(
                Transfer("fetch:anchors<-seeds", "anchors", "anchors", c * p * (a - 1), flows, after, rtt)
            )
    for s in _stages(swarm):  # a stage fetches its slice of every other replica's payload from the anchors
        nbytes = c * ((swarm.replicas - 1) * sizes.stage_bytes(s) + seal)
        after = (f"seed:stage{s}",) if prefetch else sealed
        out.append(Transfer(f"fetch:stage{s}", "anchors", f"stage{s}", nbytes, c * a, after, rtt))
    return out


def _tiles(sizes: PayloadSizes, swarm: Swarm, rtt: float) -> list[Transfer]:
    a, c, p = swarm.anchors, swarm.chains, sizes.payload_bytes
    seal = seal_bytes(sizes, a, c)
    dense = DENSE_AGGREGATE_BYTES_PER_PARAM
    # reduce-scatter: as soon as it announces, each author pushes tile range j of its payload to anchor j
    out = []
    for s in _stages(swarm):
        ps = sizes.stage_bytes(s)
        out.append(Transfer(f"reduce:stage{s}", f"stage{s}", "anchors", c * ps, c * a, delay_s=rtt))
        # the coordinator collects a stage's ranges from the aggregators to validate the whole payload
        out.append(
            Transfer(
                f"validate:stage{s}", "anchors", "coordinator", c * ps, c * a, (f"reduce:stage{s}",), rtt
            )
        )
    if a > 1:  # an anchor keeps its own range of its own payload
        out.append(Transfer("reduce:anchors", "anchors", "anchors", p * (a - 1), a * (a - 1), delay_s=rtt))
    out.append(_seal(out, rtt))
    out.append(Transfer("seal:anchors", "coordinator", "anchors", a * seal, a, ("seal",)))
    after = ("seal:anchors", *(t.name for t in out if t.name.startswith("reduce:")))
    if a > 1:  # all-gather: each anchor fetches the other ranges of the dense aggregate
        gathered = dense * sizes.parameters * (a - 1)
        out.append(Transfer("gather:anchors", "anchors", "anchors", gathered, a * (a - 1), after, rtt))
    for s in _stages(swarm):
        nbytes = c * (dense * sizes.stage_params(s) + seal)
        out.append(Transfer(f"gather:stage{s}", "anchors", f"stage{s}", nbytes, c * a, after, rtt))
    return out
