"""Which chain a stage peer is a member of, and the boundary rules that move it (docs/chains.md): form a
chain from the idle pool, follow the chain's growth, continue it with a spare after a break, or leave it.

Every rule reads the peer records (`SwarmView`) and computes the plan every peer computes
(`hetnode/planning/roles.py`); this module claims our part of it in our record and waits for the other
members' claims. Starting and stopping the stage's training is the daemon's (`run_role`): a change of
membership asks it to look again."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable

from hetnode.config import Config
from hetnode.net.records import MAX_NOSHOWS, NO_CHAIN
from hetnode.planning.roles import (
    ChainPlan,
    StageAssignment,
    assignment_for,
    format_layout,
    grown_successor,
    plan_boundary,
    stepped_in_successor,
)
from hetnode.protocol.swarm_view import SwarmView
from hetnode.service.lifecycle import sleep_or_stop
from hetnode.service.presence import Presence

log = logging.getLogger(__name__)

# a grown chain's or a successor's newcomers claim first and wait for the members, who follow once they read
# the claims: this many confirmation windows more than a new chain's members wait
GROWTH_PATIENCE = 6

RECORD_WAITS = 2  # boundaries a broken chain's member waits for its record to show the break before leaving
NOSHOW_RETRIES = 3  # boundaries a broken chain's member plans another spare after one never stepped in

ReadView = Callable[..., Awaitable[SwarmView]]  # (max_age_s=None) -> the records
RunRole = Callable[..., None]  # (stop, view=None): start or stop our role's training as the state says


class ChainMembership:
    """Our chain (`assignment`), whether it is live here, and whether our training in it ended."""

    def __init__(self, config: Config, own: str, presence: Presence, view: ReadView, run_role: RunRole):
        self.config = config
        self.own = own
        self.presence = presence
        self._view = view
        self._run_role = run_role
        self.assignment: StageAssignment | None = None
        self.live = False
        self.broken = False  # our chain's training ended: continue or leave it at the next boundary
        self._waited_for_records = 0  # boundaries waited for the records to show our chain's break
        self._noshows: list[str] = []  # spares planned into our successor that never claimed it
        self._noshow_boundaries = 0  # boundaries that planned a successor a spare did not step into
        # a spare in a successor: who held our stage before and left (may hand us its error feedback)
        self.predecessors: tuple[str, ...] = ()

    @property
    def working(self) -> str | None:
        """The chain whose stage we should be training now, if any."""
        if self.live and self.assignment is not None and not self.broken:
            return self.assignment.chain
        return None

    def leave(self) -> None:
        self.assignment, self.live, self.broken = None, False, False
        self.predecessors = ()
        self._waited_for_records = 0
        self._noshows, self._noshow_boundaries = [], 0

    async def keep_or_move(self, boundary: int, view: SwarmView, stop: asyncio.Event) -> SwarmView | None:
        """At a boundary, for a peer that wants a stage: follow our chain's growth, or continue it after a
        break. None: we moved (claimed a chain, or stopped); else the records to decide our role by."""
        held = self.assignment
        if held is not None and await self._follow_growth(boundary, view, stop):
            return None
        lost = held is not None and (self.broken or not view.chain_is_live(held.chain))
        if lost:
            if await self._continue_chain(boundary, stop):
                return None
            view = await self._view()
        return view

    def in_live_chain(self, view: SwarmView) -> bool:
        return self.assignment is not None and view.chain_is_live(self.assignment.chain) and not self.broken

    async def try_to_form(self, boundary: int, stop: asyncio.Event) -> None:
        """An idle candidate: claim our place in the chain the boundary's plan puts us in, if any."""
        n = self.config.network
        opened = time.monotonic()
        # let members of chains that dissolved at this boundary publish "idle" before we read the pool
        if await sleep_or_stop(stop, min(0.5, n.confirm_s / 3)):
            return
        plan = await self._plan(boundary)
        if plan is None:
            return
        await self._claim(plan, boundary, opened, stop)

    async def _continue_chain(self, boundary: int, stop: asyncio.Event) -> bool:
        """Our chain lost a member or broke: keep our stage in its successor if the boundary's plan has one
        (a spare steps in, or the members re-form in place), or if a spare already claimed one for it
        (`stepped_in_successor`). We claim the successor once every newcomer has, so that a spare reading
        the pool late still finds our chain as it was. False: no successor confirmed, we leave the chain."""
        n = self.config.network
        opened = time.monotonic()
        self.live = False
        self._run_role(stop)  # our stage stops; its local state on disk goes on in a successor
        if not self.broken:  # say so first: the plan keeps only the members that say the chain broke
            self.broken = True
            await self.presence.update(chain_broken=True)
        # let the other members' records say whether they are still in the chain before we read them
        if await sleep_or_stop(stop, min(0.5, n.confirm_s / 3)):
            return True
        plan = await self._plan(boundary)
        if plan is None or not plan.lineage or self.own not in plan.survivors:
            plan = await self._stepped_in()
        if plan is None and self._waited_for_records < RECORD_WAITS and not await self._break_in_records():
            # the plan is read from the records, and ours does not say the break yet (a store that no DHT
            # node took at once, after a member died): every peer still sees the chain whole. Leaving it
            # now would end its lineage; the next boundary reads the break
            self._waited_for_records += 1
            log.info("boundary %d: the records do not show our chain's break yet: next boundary", boundary)
            return True
        if plan is None:
            log.info("boundary %d: no successor for our chain (no spare for its empty stages)", boundary)
            return False
        log.info(
            "boundary %d: chain %s goes on as %s (%s)",
            boundary,
            self.assignment.chain if self.assignment else "?",
            plan.chain,
            "spares " + ", ".join(p[-6:] for p in plan.newcomers) if plan.newcomers else "re-formed in place",
        )
        deadline = opened + n.confirm_s
        missing = list(plan.newcomers)
        while time.monotonic() < deadline:
            view = await self._view(max_age_s=0)
            missing = [p for p in plan.newcomers if (view.peers.get(p) or {}).get("chain") != plan.chain]
            if not missing:
                return await self._claim(plan, boundary, time.monotonic(), stop)
            if await sleep_or_stop(stop, 0.2):
                return True
        if self._noshow_boundaries < NOSHOW_RETRIES:
            self._noshow_boundaries += 1
            # an identity can say it is idle and fast and never step in: the plan, which takes the fastest
            # spare, would pick it at every boundary. Named in our record, the next plan passes it over
            self._noshows = (self._noshows + missing)[-MAX_NOSHOWS:]
            await self.presence.update(chain_noshows=list(self._noshows))
            log.info(
                "chain %s: %s did not step in within %.1f s: the next boundary plans without them",
                plan.chain,
                ", ".join(p[-6:] for p in missing),
                n.confirm_s,
            )
            return True
        log.info("chain %s: the spares did not step in within %.1f s", plan.chain, n.confirm_s)
        return False

    async def _break_in_records(self) -> bool:
        """Whether our record, as the others read it, says our chain broke."""
        record = (await self._view(max_age_s=0)).peers.get(self.own) or {}
        return bool(record.get("chain_broken"))

    async def _stepped_in(self) -> ChainPlan | None:
        """The successor a spare already claimed for our chain (`stepped_in_successor`), as a plan."""
        held = self.assignment
        if held is None:
            return None
        chains = (await self._view(max_age_s=0)).chains()
        ours = next((c for c in chains if c.chain == held.chain), None)
        found = stepped_in_successor(ours, chains, self.own) if ours is not None else None
        if found is None:
            return None
        survivors = {peer for peer, _, _ in ours.layout} & {peer for peer, _, _ in found.layout}
        return ChainPlan.of_layout(found.chain, found.layout, found.lineage, survivors)

    async def _follow_growth(self, boundary: int, view: SwarmView, stop: asyncio.Event) -> bool:
        """Our chain grew (`plan_boundary` step 2): its spares claim the grown chain at the boundary they
        read, and we follow it once the records show it (`grown_successor`), keeping our stage and local
        state; our stage trains until then. False: nothing to follow."""
        p = self.config.pipeline
        held = self.assignment
        if p.stage_workers <= 1 or held is None:
            return False
        chains = view.chains()
        ours = next((c for c in chains if c.chain == held.chain), None)
        grown = grown_successor(ours, chains, p.stage_workers) if ours is not None else None
        if grown is None:
            return False
        members = {peer for peer, _, _ in ours.layout}
        plan = ChainPlan.of_layout(
            grown.chain, grown.layout, grown.lineage, members & {peer for peer, _, _ in grown.layout}
        )
        if self.own not in plan.survivors:
            return False
        log.info(
            "boundary %d: chain %s took %s into its pools: goes on as %s",
            boundary,
            held.chain,
            ", ".join(peer[-6:] for peer in plan.newcomers) or "nobody new",
            plan.chain,
        )
        self.live = False
        self._run_role(stop)  # our stage stops; its local state on disk goes on in the grown chain
        return await self._claim(plan, boundary, time.monotonic(), stop)

    async def _plan(self, boundary: int) -> ChainPlan | None:
        """The boundary's plan (`plan_boundary`) from the records as they are now: the chain it puts us in."""
        view = await self._view(max_age_s=0)
        pool = view.idle_candidates(boundary)
        p = self.config.pipeline
        plans = plan_boundary(
            view.chains(),
            pool,
            p.stages,
            self.config.model.n_layers,
            boundary,
            p.stage_workers,
            {peer: record["tflops"] for peer, record in view.peers.items()},
        )
        log.debug(
            "boundary %d: idle pool %s -> chains %s",
            boundary,
            sorted(c.peer_id[-6:] for c in pool),
            [[m[-6:] for m in p.members] for p in plans],
        )
        return next((p for p in plans if self.own in p.members), None)

    async def _claim(self, plan: ChainPlan, boundary: int, opened: float, stop: asyncio.Event) -> bool:
        """Claim our stage of `plan` in our record and wait, until `confirm_s` after `opened`, for every
        member to claim it; then train. False (and back to the pool) when the chain is not confirmed.
        A successor's newcomers wait longer: its survivors claim only once they saw them, up to
        `confirm_s` after they noticed the boundary, which may be later than we did."""
        n = self.config.network
        patience = (
            (GROWTH_PATIENCE + 1) * n.confirm_s
            if plan.lineage and self.own in plan.newcomers
            else n.confirm_s
        )
        mine = assignment_for([plan], self.own)
        assert mine is not None
        self.assignment, self.live, self.broken = mine, False, False
        self.predecessors = plan.predecessors_of(self.own)
        self._waited_for_records = 0
        self._noshows, self._noshow_boundaries = [], 0
        await self.presence.update(
            role="stage",
            chain=mine.chain,
            stage=mine.stage,
            layers=list(mine.layers),
            chain_layout=format_layout(mine.layout),
            chain_lineage=plan.lineage or None,
            chain_broken=None,
            chain_noshows=None,
            outer_step=boundary,
        )
        deadline = opened + patience
        view: SwarmView | None = None
        while time.monotonic() < deadline:
            view = await self._view(max_age_s=0)
            if view.chain_is_live(mine.chain):
                self.live = True
                log.info("chain %s live: stage %d, layers %d..%d", mine.chain, mine.stage, *mine.layers)
                self._run_role(stop, view)
                return True
            if await sleep_or_stop(stop, 0.2):
                return True
        problems = [c.problem for c in view.chains() if c.chain == mine.chain] if view else []
        log.info(
            "chain %s not confirmed in %.1f s (%s): back to the pool",
            mine.chain,
            patience,
            problems[0] if problems else "no claims seen",
        )
        self.leave()
        await self.presence.update(role="idle", **NO_CHAIN)
        return False
