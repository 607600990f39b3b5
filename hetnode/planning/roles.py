"""Bandwidth classes, roles and chain packing: pure decisions over one snapshot of the swarm.

Every peer runs these functions on its own view of the DHT. They are deterministic in their inputs (order
of the input never matters), so peers that see the same records compute the same plan; peers that see
different records compute different plans, and the confirmation step (`chain_status`) catches that.

A chain outlives its members (`plan_successors`): when one leaves or the chain breaks, its survivors keep
their stages and an idle peer takes each empty one at the next boundary, under a new name that carries the
chain's lineage (the name it was founded under: its data slot, `lineage_of`).
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

from hetnode.planning.layer_split import split_layers

LinkClass = Literal["high", "low", "slow"]
Role = Literal["anchor", "stage", "idle", "coordinator"]
RoleRequest = Literal["auto", "anchor", "stage"]

# Bytes of memory per parameter an anchor needs: fp32 weights, gradients, two Adam moments, the
# error-feedback buffer and the outer-step reference copy (6 x 4 bytes), plus activations headroom.
ANCHOR_BYTES_PER_PARAM = 24
ANCHOR_MEMORY_HEADROOM = 1.5


@dataclass(frozen=True)
class ClassThresholds:
    anchor_min_up_mbps: float
    anchor_min_down_mbps: float
    stage_min_up_mbps: float


def anchor_memory_gb(n_params: int) -> float:
    """Memory a full replica needs (weights, gradients, optimiser, error feedback, outer copy)."""
    return n_params * ANCHOR_BYTES_PER_PARAM * ANCHOR_MEMORY_HEADROOM / 1e9


def classify_link(
    up_mbps: float, down_mbps: float, mem_gb: float, n_params: int, thresholds: ClassThresholds
) -> LinkClass:
    """`high`: fast both ways, memory for a full replica; `low`: fast enough for a stage; else `slow`."""
    fast = up_mbps >= thresholds.anchor_min_up_mbps and down_mbps >= thresholds.anchor_min_down_mbps
    if fast and mem_gb >= anchor_memory_gb(n_params):
        return "high"
    if up_mbps >= thresholds.stage_min_up_mbps and down_mbps >= thresholds.stage_min_up_mbps:
        return "low"
    return "slow"


def wanted_role(link_class: LinkClass, request: RoleRequest) -> Role:
    """The role a peer should hold: an explicit request wins, except that a slow link takes no role.

    `auto`: high -> anchor, low -> stage. A role takes effect only at a boundary (see `next_role`).
    """
    if link_class == "slow":
        return "idle"
    if request == "anchor":
        return "anchor"
    if request == "stage":
        return "stage"
    return "anchor" if link_class == "high" else "stage"


def next_role(current: Role, in_live_chain: bool, wanted: Role) -> Role:
    """The role to hold after a boundary.

    A peer that should be an anchor becomes one (leaving any chain, which then dissolves). A peer that
    should be a stage keeps its place in a live chain, otherwise it waits in the idle pool for packing.
    """
    if wanted == "anchor":
        return "anchor"
    if wanted == "stage" and current == "stage" and in_live_chain:
        return "stage"
    return "idle"


@dataclass(frozen=True)
class Candidate:
    """An idle peer that wants a stage, as its record shows it."""

    peer_id: str
    tflops: float


# (peer id, first layer, last layer) per worker, in stage order: consecutive entries with the same layers
# are one stage's pool of workers (`stage_pools`); a chain without pools has one entry per stage
Layout = tuple[tuple[str, int, int], ...]
Pool = tuple[tuple[str, ...], int, int]  # one stage: its workers, its first and last layer


def stage_pools(layout: Layout) -> tuple[Pool, ...]:
    """A layout's stages in order, each with its workers (consecutive entries with the same layers)."""
    pools: list[tuple[list[str], int, int]] = []
    for peer, first, last in layout:
        if pools and (pools[-1][1], pools[-1][2]) == (first, last):
            pools[-1][0].append(peer)
        else:
            pools.append(([peer], first, last))
    return tuple((tuple(workers), first, last) for workers, first, last in pools)


def stage_of(layout: Layout, peer_id: str) -> int | None:
    """The stage `peer_id` works at in `layout` (None: not in it)."""
    for index, (workers, _, _) in enumerate(stage_pools(layout)):
        if peer_id in workers:
            return index
    return None


@dataclass(frozen=True)
class StageAssignment:
    chain: str
    stage: int
    peer_id: str
    layers: tuple[int, int]  # first, last (inclusive)
    layout: Layout = ()  # the whole chain's assignment, which the chain's name commits to


@dataclass(frozen=True)
class ChainPlan:
    chain: str
    stages: tuple[StageAssignment, ...]
    lineage: str = ""  # a successor's: the name its chain was founded under ("" for a new chain)
    survivors: tuple[str, ...] = ()  # a successor's members that held their stage before
    # a successor's newcomers, each with the members that held its stage before and may hand over the
    # stage's error feedback (left, not caught lying: `feedback_handoff`)
    predecessors: tuple[tuple[str, tuple[str, ...]], ...] = ()

    @classmethod
    def of_layout(cls, chain: str, layout: Layout, lineage: str, survivors: Iterable[str]) -> ChainPlan:
        """The plan a chain's committed layout stands for (as its claims show it)."""
        stage_at = {p: i for i, (workers, _, _) in enumerate(stage_pools(layout)) for p in workers}
        return cls(
            chain,
            tuple(StageAssignment(chain, stage_at[p], p, (f, la), layout) for p, f, la in layout),
            lineage,
            tuple(sorted(set(survivors))),
        )

    @property
    def newcomers(self) -> tuple[str, ...]:
        """The members that step in (all of a new chain's)."""
        return tuple(p for p in self.members if p not in self.survivors)

    @property
    def members(self) -> tuple[str, ...]:
        return tuple(s.peer_id for s in self.stages)

    def predecessors_of(self, peer_id: str) -> tuple[str, ...]:
        return next((former for newcomer, former in self.predecessors if newcomer == peer_id), ())


def chain_id(boundary: int, assignments: Sequence[tuple[str, tuple[int, int]]], lineage: str = "") -> str:
    """A name that commits to the whole assignment (and to the lineage of a successor): peers that agree on
    it agree on every stage."""
    head = f"{boundary}|{lineage}|" if lineage else f"{boundary}|"
    text = head + "|".join(f"{peer}:{first}-{last}" for peer, (first, last) in assignments)
    return f"{chain_prefix(boundary)}{hashlib.sha256(text.encode()).hexdigest()[:10]}"


def lineage_of(chain: str, lineage: str = "") -> str:
    """The name a chain was founded under, which its successors keep: what its data slot and assigned
    batches hash (`planning.rounds.data_slot`). A founding chain's lineage is its own name."""
    return lineage or chain


def chain_prefix(boundary: int) -> str:
    """Every chain formed at `boundary` has a name starting with this."""
    return f"c{boundary}-"


def pack_chains(
    idle: Iterable[Candidate],
    stages_per_chain: int,
    n_layers: int,
    boundary: int,
    stage_workers: int = 1,
) -> list[ChainPlan]:
    """Pack idle stage candidates into chains of `stages_per_chain`, layers split by each member's compute.

    Candidates are sorted by (compute descending, peer id) and cut into consecutive groups, so each
    chain gets members of similar speed and its slowest stage limits it least. Within a chain the faster
    member takes the earlier stage (the first stage also loads data). Left-over peers join the pools of
    the chains' slowest stages, up to `stage_workers` workers a stage (`_fill_pools`), or stay idle."""
    drafts, left = _pack_drafts(idle, stages_per_chain, n_layers, stage_workers)
    _fill_pools(drafts, left, stage_workers)
    return [draft.plan(boundary) for draft in drafts]


@dataclass
class _Draft:
    """A chain being planned, before its name: each stage's workers and layers."""

    pools: list[list[str]]
    layers: list[tuple[int, int]]
    compute: dict[str, float]  # TFLOP/s of each worker, as its record says
    lineage: str = ""
    survivors: tuple[str, ...] = ()
    refused: frozenset[str] = frozenset()  # peers this chain takes no more (`ChainStatus.accused`)
    former: tuple[tuple[str, ...], ...] = ()  # a successor's: who held each stage before and left

    def per_layer(self, stage: int) -> float:
        """The stage's compute per layer: where a spare helps most is where this is least."""
        first, last = self.layers[stage]
        return sum(self.compute.get(p, 0.0) for p in self.pools[stage]) / (last - first + 1)

    def plan(self, boundary: int) -> ChainPlan:
        layout = tuple(
            (peer, first, last)
            for workers, (first, last) in zip(self.pools, self.layers, strict=True)
            for peer in workers
        )
        name = chain_id(boundary, [(p, (f, la)) for p, f, la in layout], self.lineage)
        stage_at = {peer: i for i, workers in enumerate(self.pools) for peer in workers}
        return ChainPlan(
            chain=name,
            stages=tuple(
                StageAssignment(
                    chain=name, stage=stage_at[peer], peer_id=peer, layers=(first, last), layout=layout
                )
                for peer, first, last in layout
            ),
            lineage=self.lineage,
            survivors=self.survivors,
            predecessors=self._predecessors(),
        )

    def _predecessors(self) -> tuple[tuple[str, tuple[str, ...]], ...]:
        """Each stage's first newcomer, with who held the stage before: one taker per stage, or a pool
        of newcomers would send the same feedback twice."""
        taken = []
        for workers, former in zip(self.pools, self.former, strict=False):
            newcomers = [peer for peer in workers if peer not in self.survivors]
            if newcomers and former:
                taken.append((newcomers[0], former))
        return tuple(taken)


def _pack_drafts(
    idle: Iterable[Candidate], stages_per_chain: int, n_layers: int, stage_workers: int = 1
) -> tuple[list[_Draft], list[Candidate]]:
    """Chains of the fastest candidates, P a chain: as few as hold every candidate once the pools of their
    stages past the first are full (`stage_workers` each), so that a chain's pools fill before another
    chain forms. The rest are left for the pools."""
    if stages_per_chain < 1:
        raise ValueError(f"stages_per_chain must be >= 1, got {stages_per_chain}")
    unique = {c.peer_id: c for c in idle}
    ordered = sorted(unique.values(), key=lambda c: (-c.tflops, c.peer_id))
    # as few chains as hold everyone, each with full pools past its first stage; never more than P apiece
    holds = stages_per_chain + (stages_per_chain - 1) * (max(stage_workers, 1) - 1)
    count = min(len(ordered) // stages_per_chain, -(-len(ordered) // holds))
    drafts = []
    for start in range(0, count * stages_per_chain, stages_per_chain):
        members = ordered[start : start + stages_per_chain]
        ranges = split_layers(n_layers, [max(m.tflops, 1e-6) for m in members])
        drafts.append(
            _Draft(
                [[m.peer_id] for m in members],
                [(r.start, r.stop - 1) for r in ranges],
                {m.peer_id: m.tflops for m in members},
            )
        )
    return drafts, ordered[count * stages_per_chain :]


def _fill_pools(drafts: Sequence[_Draft], spares: Sequence[Candidate], stage_workers: int) -> list[Candidate]:
    """Give each spare, fastest first, to the stage of `drafts` with the least compute per layer whose
    pool has room (ties: the earlier chain, then the later stage: the last one also runs the head).
    The first stage keeps one worker: it reads the chain's data and names each round's T_fix', which
    every worker downstream takes from one sender. Returns the spares left over."""
    left = []
    for spare in sorted(spares, key=lambda c: (-c.tflops, c.peer_id)):
        open_stages = [
            (draft.per_layer(s), d, -s)
            for d, draft in enumerate(drafts)
            if spare.peer_id not in draft.refused
            for s in range(1, len(draft.pools))
            if len(draft.pools[s]) < stage_workers
        ]
        if not open_stages:
            left.append(spare)
            continue
        _, d, neg_stage = min(open_stages)
        drafts[d].pools[-neg_stage].append(spare.peer_id)
        drafts[d].compute[spare.peer_id] = spare.tflops
    return left


def assignment_for(plans: Sequence[ChainPlan], peer_id: str) -> StageAssignment | None:
    for plan in plans:
        for stage in plan.stages:
            if stage.peer_id == peer_id:
                return stage
    return None


@dataclass(frozen=True)
class Claim:
    """What one peer's record says about its chain: its stage and layers, and the whole layout."""

    peer_id: str
    chain: str
    stage: int
    layers: tuple[int, int]
    layout: Layout = ()
    lineage: str = ""  # a successor's lineage, which its name commits to
    broken: bool = False  # the claimer's training in this chain ended (a neighbour left or misbehaved)
    blame: str = ""  # the member whose frame failed the claimer's checks
    noshows: tuple[str, ...] = ()  # spares planned into the claimer's successor that never claimed it


@dataclass(frozen=True)
class ChainStatus:
    chain: str
    live: bool
    stages: tuple[str | None, ...]  # peer id per stage, None where no member claims it
    problem: str  # empty when live
    lineage: str = ""  # the name the chain was founded under (`lineage_of`)
    layout: Layout = ()  # what the name commits to (empty when no claim commits to it)
    broken: tuple[str, ...] = ()  # members whose record says their training in the chain ended
    blamed: tuple[str, ...] = ()  # members another member caught sending what no honest stage sends
    # each stage's working members: they claim it, and neither say it broke nor were caught lying
    workers: tuple[tuple[str, ...], ...] = ()
    # every peer a member's record names as caught lying, in or out of the layout: the chain takes none
    # of them into its pools (a liar dropped from a chain does not come back to it as a spare)
    accused: tuple[str, ...] = ()
    # spares a member named as planned into its successor and never claiming it (an identity that says it
    # is idle and fast and never steps in): the chain's successors are planned without them
    noshows: tuple[str, ...] = ()

    @property
    def members(self) -> set[str]:
        """Every peer its layout names."""
        return {peer for peer, _, _ in self.layout}

    @property
    def dropped(self) -> dict[str, str]:
        """The members of the layout that no longer work in the chain, and why (for people to read)."""
        working = {p for workers in self.workers for p in workers}
        reasons = {}
        for peer, _, _ in self.layout:
            if peer in working:
                continue
            if peer in self.blamed:
                reasons[peer] = "caught lying"
            elif peer in self.broken:
                reasons[peer] = "its training in the chain ended"
            else:
                reasons[peer] = "left"
        return reasons


def format_layout(layout: Layout) -> list[str]:
    """A layout as records carry it: "peer:first-last" per stage (the text `chain_id` hashes)."""
    return [f"{peer}:{first}-{last}" for peer, first, last in layout]


def parse_layout(members: Iterable[str]) -> Layout:
    """`format_layout` reversed; a malformed member gives an empty layout (a claim committing to nothing)."""
    layout = []
    for member in members:
        peer, _, span = member.rpartition(":")
        first, _, last = span.partition("-")
        if not (peer and first.isdigit() and last.isdigit()):
            return ()
        layout.append((peer, int(first), int(last)))
    return tuple(layout)


def commits(claim: Claim) -> bool:
    """True when `claim` is one its chain's name commits to: the layout hashes to the name, and the claimer
    sits at its stage with its layers in that layout. Anyone else's claim on the name is noise
    (docs/security.md, "Exhaust a daemon")."""
    boundary = _boundary_of(claim.chain)
    layout = claim.layout
    if boundary is None or (claim.peer_id, *claim.layers) not in layout:
        return False
    if stage_of(layout, claim.peer_id) != claim.stage:
        return False
    if claim.lineage:  # a lineage is a chain founded at an earlier boundary
        founded = _boundary_of(claim.lineage)
        if founded is None or founded >= boundary:
            return False
    assignments = [(peer, (first, last)) for peer, first, last in layout]
    return chain_id(boundary, assignments, claim.lineage) == claim.chain


def chain_status(
    claims: Iterable[Claim], stages_per_chain: int, n_layers: int, stage_workers: int = 1
) -> list[ChainStatus]:
    """Group claims by chain; a chain is live when every stage of the layout its name commits to has a
    working member: one that claims it, does not say it broke and was not caught lying by another member.

    Only claims that commit to the name count (`commits`), so a stranger claiming a live chain's name and
    stage changes nothing. The layout must have `stages_per_chain` stages of at most `stage_workers`
    workers each, whose layer ranges are contiguous in stage order and cover 0..n_layers-1 exactly once.
    """
    by_chain: dict[str, list[Claim]] = {}
    for claim in claims:
        by_chain.setdefault(claim.chain, []).append(claim)
    result = []
    for name in sorted(by_chain):
        valid = [c for c in by_chain[name] if commits(c)]
        if not valid:
            result.append(
                ChainStatus(name, False, (None,) * stages_per_chain, "claims do not match the chain's name")
            )
            continue
        layout = valid[0].layout  # every valid claim has it: the name commits to one layout
        lineage = lineage_of(name, valid[0].lineage)
        claimed = {c.peer_id for c in valid}
        broken = tuple(sorted(c.peer_id for c in valid if c.broken))
        members = {peer for peer, _, _ in layout}
        blamed = tuple(sorted({c.blame for c in valid if c.blame in members - {c.peer_id}}))
        gone = set(broken) | set(blamed)
        pools = stage_pools(layout)
        workers = tuple(tuple(p for p in pool if p in claimed and p not in gone) for pool, _, _ in pools)
        slots = tuple(w[0] if w else None for w in workers)
        problem = _layout_problem(layout, stages_per_chain, n_layers, stage_workers)
        if not problem:
            empty = [i for i, w in enumerate(workers) if not w]
            if empty and any(p in broken for p in pools[empty[0]][0]):
                problem = f"broken (says {', '.join(p[-6:] for p in broken)})"
            elif empty and any(p in blamed for p in pools[empty[0]][0]):
                problem = f"stage {empty[0]}'s member was caught lying"
            elif empty:
                problem = f"stage {empty[0]} has no member"
        accused = tuple(sorted({c.blame for c in valid if c.blame and c.blame != c.peer_id}))
        noshows = tuple(sorted({p for c in valid for p in c.noshows} - members))
        result.append(
            ChainStatus(
                name, not problem, slots, problem, lineage, layout, broken, blamed, workers, accused, noshows
            )
        )
    return result


def plan_successors(
    chains: Iterable[ChainStatus],
    idle: Iterable[Candidate],
    stages_per_chain: int,
    n_layers: int,
    boundary: int,
    stage_workers: int = 1,
    compute: Mapping[str, float] | None = None,
) -> tuple[list[ChainPlan], list[Candidate]]:
    """At `boundary`, continue every chain formed earlier that lost a stage or broke: its survivors keep
    their stages and layers (their local state stays valid) and idle candidates, fastest first, take the
    empty stages. Returns the successors, and the candidates left for `pack_chains`.

    Survivors: the members whose record says their training in the chain ended. An honest member's does
    within seconds of a neighbour leaving (the stream breaks at both ends, or its watch sees the neighbour's
    record gone); a member that says nothing is taken for gone, and so is a departed peer whose record has
    not expired yet. A member that another member blames (its frame failed the receiver's checks: what no
    honest stage sends) is not a survivor either: the chain goes on without it. Two that blame each other
    both leave (a liar costs its victim its place, and loses its own). A broken chain whose members all
    survive re-forms in place; a stage's pool keeps its surviving workers.
    A chain with more empty stages than there are candidates is not continued: its survivors go back to
    the pool. A lineage is continued once: not while it has a live chain (a member that noticed the break
    late is left behind by its successor, and goes back to the pool). Chains are served in name order, so
    every peer hands the same spare to the same chain. `compute`: TFLOP/s per peer (`_fill_pools`)."""
    drafts, pool = _successor_drafts(chains, idle, stages_per_chain, n_layers, boundary, compute or {})
    return [d.plan(boundary) for d in drafts], pool


def _successor_drafts(
    chains: Iterable[ChainStatus],
    idle: Iterable[Candidate],
    stages_per_chain: int,
    n_layers: int,
    boundary: int,
    compute: Mapping[str, float],
) -> tuple[list[_Draft], list[Candidate]]:
    chains = list(chains)
    live = [status for status in chains if status.live]
    candidates = [
        status
        for status in chains
        if not status.live and (formed := _boundary_of(status.chain)) is not None and formed < boundary
    ]
    # one successor per chain of a lineage: of the chains that share members, the one whose members say it
    # broke (they are there to say so), then the newest (an older one's claims are a straggler's, or a
    # departed member's record); none while a live chain of the lineage holds one of its members (its
    # successor runs: a member that noticed the break late is left behind). A lineage is a bare claim that
    # any identity can make for a chain of its own: a chain of the lineage with none of our members neither
    # takes our place nor stops us (docs/security.md, "Claiming a broken chain's successor")
    chosen: list[ChainStatus] = []
    for status in candidates:
        mine = status.members
        if any(c.lineage == status.lineage and c.members & mine for c in live):
            continue
        if any(
            other.lineage == status.lineage and other.members & mine and _rank(other) > _rank(status)
            for other in candidates
        ):
            continue
        chosen.append(status)
    pool = sorted({c.peer_id: c for c in idle}.values(), key=lambda c: (-c.tflops, c.peer_id))
    drafts = []
    for status in sorted(chosen, key=lambda c: c.chain):
        if _layout_problem(status.layout, stages_per_chain, n_layers, len(status.layout)):
            continue
        survivors = set(status.broken) - set(status.blamed)
        if not survivors:
            continue
        stages = stage_pools(status.layout)
        kept = [[p for p in workers if p in survivors] for workers, _, _ in stages]
        vacant = [i for i, workers in enumerate(kept) if not workers]
        passed_over = set(survivors) | set(status.accused) | set(status.noshows)
        spares = [c for c in pool if c.peer_id not in passed_over]
        spares = spares[: len(vacant)]
        if len(spares) < len(vacant):
            continue
        taken = {c.peer_id for c in spares}
        pool = [c for c in pool if c.peer_id not in taken]
        for i, spare in zip(vacant, spares, strict=True):
            kept[i] = [spare.peer_id]
        speeds = {p: compute.get(p, 0.0) for workers in kept for p in workers}
        speeds |= {c.peer_id: c.tflops for c in spares}
        layers = [(f, la) for _, f, la in stages]
        refused = frozenset(status.accused)
        # who may hand a newcomer its stage's error feedback: a member that left, never one caught lying
        liars = set(status.blamed) | refused
        former = tuple(
            tuple(p for p in workers if p not in survivors and p not in liars) for workers, _, _ in stages
        )
        drafts.append(_Draft(kept, layers, speeds, status.lineage, tuple(sorted(survivors)), refused, former))
    return drafts, pool


def plan_boundary(
    chains: Iterable[ChainStatus],
    idle: Iterable[Candidate],
    stages_per_chain: int,
    n_layers: int,
    boundary: int,
    stage_workers: int = 1,
    compute: Mapping[str, float] | None = None,
) -> list[ChainPlan]:
    """Every peer's plan at `boundary`:
    1. successors of the chains that lost a stage (`plan_successors`): their empty stages come first;
    2. with `stage_workers` > 1, live chains whose pools have room grow: idle candidates join the stage
       with the least compute per layer (`_fill_pools`), and the chain goes on under a new name with its
       lineage (`_grown_drafts`): a chain's slowest stages get their workers before another chain forms;
    3. new chains from the candidates left (`_pack_drafts`), the spares left over joining the pools of
       the successors and new chains.
    `compute`: TFLOP/s per peer, as the records say (a member's speed, for where a spare helps most)."""
    chains = list(chains)
    compute = compute or {}
    successors, left = _successor_drafts(chains, idle, stages_per_chain, n_layers, boundary, compute)
    grown, left = _grown_drafts(chains, left, boundary, stage_workers, compute)
    packed, left = _pack_drafts(left, stages_per_chain, n_layers, stage_workers)
    _fill_pools(successors + packed, left, stage_workers)
    return [draft.plan(boundary) for draft in successors + grown + packed]


def grown_successor(
    ours: ChainStatus, chains: Iterable[ChainStatus], stage_workers: int
) -> ChainStatus | None:
    """The chain our chain grew into, as the records show it: formed later under our lineage, with our
    stages and layers, every working member of ours where it is, and the rest newcomers in the pools of
    stages past the first (at most `stage_workers` a stage), each claiming it and none caught lying by us.
    The newest such chain, or None. Members follow it at whatever boundary they read it (peers act on
    boundaries a few seconds apart: a plan computed at each would name it differently)."""
    mine = stage_pools(ours.layout)
    working = {p: i for i, workers in enumerate(ours.workers) for p in workers}
    best: ChainStatus | None = None
    for status in chains:
        formed, since = _boundary_of(status.chain), _boundary_of(ours.chain)
        if formed is None or since is None or formed <= since or status.lineage != ours.lineage:
            continue
        pools = stage_pools(status.layout)
        if [(f, la) for _, f, la in pools] != [(f, la) for _, f, la in mine] or not working:
            continue
        at = {p: i for i, (workers, _, _) in enumerate(pools) for p in workers}
        claimed = {p for workers in status.workers for p in workers}
        newcomers = set(at) - set(working)
        if (
            any(at.get(p) != i for p, i in working.items())
            or any(at[p] == 0 or p not in claimed or p in ours.accused for p in newcomers)
            or any(len(workers) > stage_workers for workers, _, _ in pools[1:])
            or not newcomers
        ):
            continue
        if best is None or (formed, status.chain) > (_boundary_of(best.chain) or 0, best.chain):
            best = status
    return best


def stepped_in_successor(ours: ChainStatus, chains: Iterable[ChainStatus], own: str) -> ChainStatus | None:
    """The successor spares stepped into for our broken chain, as the records show it: formed later under
    our lineage, with our stages and layers, us at our stage, and every member that was not one of ours
    claiming it, none caught lying by us. The newest such chain, or None. A member whose own plan found no
    successor follows it: a spare that read the break a boundary before us claimed it then, and is no
    spare in the records we read (measured: the chain dissolved and lost three more rounds)."""
    mine = stage_pools(ours.layout)
    ours_members = ours.members
    our_stage = stage_of(ours.layout, own)
    since = _boundary_of(ours.chain)
    best: ChainStatus | None = None
    for status in chains:
        formed = _boundary_of(status.chain)
        if formed is None or since is None or formed <= since or status.lineage != ours.lineage:
            continue
        pools = stage_pools(status.layout)
        if our_stage is None or [(f, la) for _, f, la in pools] != [(f, la) for _, f, la in mine]:
            continue
        claimed = {p for workers in status.workers for p in workers}
        newcomers = status.members - ours_members
        if (
            stage_of(status.layout, own) != our_stage
            or not newcomers
            or any(p not in claimed or p in ours.accused for p in newcomers)
        ):
            continue
        if best is None or (formed, status.chain) > (_boundary_of(best.chain) or 0, best.chain):
            best = status
    return best


def _grown_drafts(
    chains: Sequence[ChainStatus],
    idle: Sequence[Candidate],
    boundary: int,
    stage_workers: int,
    compute: Mapping[str, float],
) -> tuple[list[_Draft], list[Candidate]]:
    """The live chains formed before `boundary` that take spares into their pools: each goes on with its
    working members where they are (their local state stays valid) and the spares, under its lineage."""
    if stage_workers <= 1 or not idle:
        return [], list(idle)
    drafts = []
    for status in sorted(chains, key=lambda c: c.chain):
        formed = _boundary_of(status.chain)
        if not status.live or formed is None or formed >= boundary:
            continue
        stages = stage_pools(status.layout)
        pools = [list(workers) for workers in status.workers]
        members = tuple(sorted(p for workers in pools for p in workers))
        speeds = {p: compute.get(p, 0.0) for p in members}
        layers = [(f, la) for _, f, la in stages]
        drafts.append(_Draft(pools, layers, speeds, status.lineage, members, frozenset(status.accused)))
    sizes = [sum(len(w) for w in d.pools) for d in drafts]
    left = _fill_pools(drafts, idle, stage_workers)
    return [d for d, size in zip(drafts, sizes, strict=True) if sum(len(w) for w in d.pools) > size], left


def _layout_problem(layout: Layout, stages_per_chain: int, n_layers: int, stage_workers: int = 1) -> str:
    pools = stage_pools(layout)
    if len(pools) != stages_per_chain:
        return f"{len(pools)} stages, the run has {stages_per_chain}"
    if len({peer for peer, _, _ in layout}) != len(layout):
        return "a peer holds two places"
    expected_first = 0
    for stage, (workers, first, last) in enumerate(pools):
        if first != expected_first or last < first:
            return f"stage {stage} layers {first}..{last} break the cover"
        if len(workers) > stage_workers:
            return f"stage {stage} has {len(workers)} workers, the run allows {stage_workers}"
        expected_first = last + 1
    if expected_first != n_layers:
        return f"layers cover 0..{expected_first - 1} of 0..{n_layers - 1}"
    return ""


def formed_at(name: str) -> int | None:
    """The boundary a chain was formed at, from its name (None: not a chain's name)."""
    return _boundary_of(name)


def _rank(status: ChainStatus) -> tuple[bool, int, str]:
    """Which of a lineage's broken chains is continued: one whose members say it broke, then the newest."""
    return bool(status.broken), _boundary_of(status.chain) or 0, status.chain


def _boundary_of(name: str) -> int | None:
    head = name[1:].split("-", 1)[0] if name.startswith("c") else ""
    return int(head) if head.isdigit() else None
