"""A chain stage's links to its neighbouring stages' workers: one duplex stream per pair of workers, opened
by the earlier stage (docs/chains.md, "Pools and routing").

Activation frames go down the link the routing picks (`planning.routing.pick_worker`); each micro-batch's
gradient comes back on the link it went down, and goes on up the link it came from. A sender keeps each
frame it sent until the gradient is back: when a worker of the next stage leaves, stalls or is caught
lying, its micro-batches go to another worker of its pool and the round goes on. The stage breaks only
when a whole neighbouring stage is gone.

A share of the micro-batches (`pipeline.audit_share`, drawn so that no neighbour can predict it) also goes
to a second worker of the pool, which cannot tell it from its own: a second opinion on the gradient the
first sends back (`Audit`; judged by the stage, `ChainLoop._second_opinion`).

Links are made while the chain starts (every working member of the neighbouring pools that connects
within `CONNECT_S`) and only lost after, so that every sender ends every round on every link it has
(`end` frames) and a receiver knows whom it waits for.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

import torch

from hetnode.errors import HetnodeError, WireError
from hetnode.net.node import SwarmNode
from hetnode.net.streams import OpenStream, PeerRequestError, read_frame, write_frame
from hetnode.planning.roles import stage_pools
from hetnode.planning.routing import ServiceTime, WorkerLoad, pick_worker
from hetnode.protocol.view import SwarmView
from hetnode.service.lifecycle import sleep_or_stop

log = logging.getLogger(__name__)

CONNECT_S = 30.0  # neighbours must be connected this soon after the chain went live
STRAGGLER_S = 10.0  # with a link each way, how long the others of the neighbouring pools are waited for
WRITE_SLACK = 4.0  # a frame write may take this many times its transfer at our measured upload rate
MIN_WRITE_TIMEOUT_S = 30.0  # plus this: the first bytes wait for a window, a round trip, a busy neighbour


def frame_write_timeout_s(nbytes: int, up_mbps: float) -> float:
    """How long one frame write may take before the neighbour counts as stalled: the transfer at our
    measured upload rate, `WRITE_SLACK` times, plus `MIN_WRITE_TIMEOUT_S`. A fixed timeout either breaks a
    slow honest link on a large frame or waits minutes for a dead neighbour on a fast one."""
    transfer_s = nbytes * 8 / (max(up_mbps, 1e-3) * 1e6)
    return MIN_WRITE_TIMEOUT_S + WRITE_SLACK * transfer_s


class ChainBroken(HetnodeError):
    """This chain cannot go on (a neighbouring stage is gone, or its only worker sent something invalid)."""

    def __init__(self, message: str, blame: str | None = None) -> None:
        super().__init__(message)
        self.blame = blame  # the neighbour whose frame failed our checks (it cannot be an honest one's)


class LinkFailed(HetnodeError):
    """One link cannot go on: its stream ended, or its worker sent what no honest stage sends (`blame`)."""

    def __init__(self, message: str, blame: bool = False) -> None:
        super().__init__(message)
        self.blame = blame


@dataclass(frozen=True)
class ChainLayout:
    chain: str
    index: int  # our stage
    pools: tuple[tuple[str, ...], ...]  # the workers of each stage, in stage order (one each: no pools)
    splits: tuple[range, ...]  # layers of each stage
    lineage: str = ""  # the name the chain was founded under: whose data slot it trains on

    @classmethod
    def from_view(cls, view: SwarmView, chain: str, peer_id: str) -> ChainLayout | None:
        """The live chain `chain` as the records say, or None when it is not live or we do not work in it."""
        status = next((c for c in view.chains() if c.chain == chain and c.live), None)
        if status is None:
            return None
        index = next((i for i, workers in enumerate(status.workers) if peer_id in workers), None)
        if index is None:
            return None
        stages = stage_pools(status.layout)
        pools = tuple(workers for workers, _, _ in stages)
        splits = tuple(range(first, last + 1) for _, first, last in stages)
        return cls(chain, index, pools, splits, status.lineage)

    @property
    def stages(self) -> int:
        return len(self.pools)

    @property
    def first(self) -> bool:
        return self.index == 0

    @property
    def last(self) -> bool:
        return self.index == self.stages - 1

    @property
    def upstream(self) -> tuple[str, ...]:
        """The previous stage's workers (none for the first stage)."""
        return () if self.first else self.pools[self.index - 1]

    @property
    def width_after(self) -> int:
        """The most workers any later stage has: a stage keeps that many times its window in flight."""
        return max((len(pool) for pool in self.pools[self.index + 1 :]), default=1)

    @property
    def downstream(self) -> tuple[str, ...]:
        """The next stage's workers (none for the last stage)."""
        return () if self.last else self.pools[self.index + 1]


@dataclass(eq=False)
class Link:
    """One stream to one worker of a neighbouring stage."""

    peer: str
    stream: OpenStream
    lost: bool = False
    # a link to the next stage: what we sent it in the open round, and how fast it answers
    served: int = 0
    answered: int = 0  # of those, answered
    service: ServiceTime = field(default_factory=ServiceTime)
    # a link from the previous stage: what it sent us in the open round
    received: int = 0
    ended: bool = False  # its end frame of the open round arrived
    drift_round: int = -1  # the round of the last drift frame it sent


@dataclass
class Routed:
    """A micro-batch we sent down and wait to hear back about: where, the frame (to send it again), when
    and behind how many others on that link."""

    link: Link
    frame: bytes
    sent_at: float
    queue: int
    timed: bool = True  # False: its answer was already here (a copy's), so its round trip says nothing


@dataclass
class Audit:
    """A micro-batch sent to more than one worker of the next stage's pool: the routed one first, a second
    (and a third, when two disagree) unknown to them; the gradients each sent back."""

    frame: bytes
    asked: list[str]  # the workers it went to, its route first
    grads: dict[str, torch.Tensor] = field(default_factory=dict)
    void: bool = False  # a worker asked was lost: the copies still out are taken and dropped

    @property
    def waiting(self) -> list[str]:
        return [p for p in self.asked if p not in self.grads]


class Neighbours:
    """The links of one stage to the workers of the stages before and after it: connecting, routing,
    sending, and losing them (a lost link's micro-batches go to another worker of its pool)."""

    def __init__(
        self,
        node: SwarmNode,
        layout: ChainLayout,
        up_mbps: Callable[[], float],
        on_blame: Callable[[str, str], Awaitable[None]],
        audit_share: float = 0.0,
        step_cap: int = 0,
    ) -> None:
        """`up_mbps`: our upload rate (write timeouts); `on_blame(peer, why)`: a neighbour was caught sending
        what no honest stage sends (said in our record); `audit_share`: of the micro-batches we route, the
        share a second worker of the pool also gets, never past `step_cap` micro-batches a round to one
        worker (which refuses more)."""
        self.node = node
        self.layout = layout
        self.up_mbps = up_mbps
        self.on_blame = on_blame
        self.ups: dict[str, Link] = {}  # links from the previous stage's workers
        self.downs: dict[str, Link] = {}  # links to the next stage's workers
        self.routed: dict[int, Routed] = {}  # micro-batches down the links, not answered yet
        self.came_from: dict[int, Link] = {}  # the link each micro-batch in flight here arrived on
        self.audit_share = audit_share
        self.step_cap = step_cap
        self.audits: dict[int, Audit] = {}  # micro-batches with a second opinion asked, not judged yet
        self.copies = 0  # copies sent for second opinions in the open round
        # the workers each micro-batch of the open round went to (routed or copied): one never gets the same
        # micro-batch twice (it would count it twice against its round's cap, and refuse us)
        self.sent_to: dict[int, set[str]] = {}
        # a copy's gradient, kept when its audit was voided by the loss of the worker the micro-batch was
        # routed to: it answers the micro-batch instead of sending it again
        self.spare_answers: dict[int, tuple[str, torch.Tensor]] = {}
        self._draw = random.SystemRandom()  # which micro-batches get one: nothing a neighbour can predict
        self.blamed: str | None = None  # the first neighbour we caught lying
        self.accepting = True  # links from upstream are taken while the chain starts
        self.bytes_sent = 0
        self.bytes_received = 0
        self.send_s = 0.0
        self.attached = asyncio.Event()  # a link from upstream was accepted
        self.on_up_link: Callable[[Link], None] | None = None  # the stage starts reading a new link
        self.on_lost: Callable[[Link], None] | None = None  # the stage recounts its round
        # a micro-batch whose worker was lost is answered by the gradient another worker sent for its copy
        self.on_spare_answer: Callable[[int, Link, torch.Tensor], None] | None = None

    # --- making links --------------------------------------------------------------------------------

    async def connect(self, working: set[str], stop: asyncio.Event) -> None:
        """Open a link to each expected member of the next stage's pool and wait for links from the previous
        stage's, until every one is there; or, with one each way, `STRAGGLER_S` passed (a member that
        joins its chain a moment after us still gets in: links are made only now); else until
        `CONNECT_S`."""
        layout = self.layout
        started = time.monotonic()
        deadline = started + CONNECT_S
        wanted_down = [p for p in layout.downstream if p in working]
        wanted_up = {p for p in layout.upstream if p in working}
        problems: dict[str, str] = {}
        while True:
            for peer in wanted_down:
                if peer not in self.downs:
                    problem = await self._open(peer)
                    if problem:
                        problems[peer] = problem
            missing_down = [p for p in wanted_down if p not in self.downs]
            missing_up = wanted_up - set(self.ups)
            if not missing_down and not missing_up:
                break
            enough = (self.downs or layout.last) and (self.ups or layout.first)
            if enough and time.monotonic() > started + STRAGGLER_S:
                break
            if time.monotonic() > deadline:
                if enough:
                    break
                if not self.downs and not layout.last:
                    raise ChainBroken(f"cannot reach the next stage: {'; '.join(problems.values())}")
                raise ChainBroken("the previous stage did not connect")
            if await sleep_or_stop(stop, 0.1 if not missing_down else 0.5):
                return
        self.accepting = False
        for peer in (*[p for p in wanted_down if p not in self.downs], *(wanted_up - set(self.ups))):
            log.info("chain %s: %s did not connect: going on without it", layout.chain, peer)

    async def _open(self, peer: str) -> str:
        """Open our link to `peer` of the next stage; "" once it accepted, else what went wrong."""
        try:
            stream = await self.node.open_stage_stream(peer)
        except PeerRequestError as exc:
            return str(exc)
        try:  # the next stage accepts with an empty frame once its own chain loop runs
            await read_frame(stream.reader, 0, timeout=5.0)
        except (TimeoutError, asyncio.IncompleteReadError, ConnectionError, WireError) as exc:
            stream.close()
            return f"not accepted yet ({type(exc).__name__})"
        self.downs[peer] = Link(peer, stream)
        return ""

    async def accept(self, peer: str, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> bool:
        """Take a link from `peer` if it works at the previous stage and the chain is starting (False:
        refused)."""
        if peer not in self.layout.upstream or peer in self.ups or not self.accepting:
            log.warning(
                "chain %s: refusing a stream from %s (not a worker of our previous stage, or too late)",
                self.layout.chain,
                peer,
            )
            return False
        await write_frame(writer, b"", 5.0)  # accepted
        link = Link(peer, OpenStream(peer, reader, writer))
        self.ups[peer] = link
        self.attached.set()
        if self.on_up_link is not None:
            self.on_up_link(link)
        return True

    def close(self) -> None:
        for link in (*self.ups.values(), *self.downs.values()):
            link.stream.close()

    # --- the round's view of the links ---------------------------------------------------------------

    def live(self, links: dict[str, Link]) -> list[Link]:
        return [link for link in links.values() if not link.lost]

    def new_round(self) -> None:
        self.copies = 0
        self.sent_to.clear()
        self.spare_answers.clear()
        for link in (*self.ups.values(), *self.downs.values()):
            link.served = link.received = link.answered = 0
            link.ended = False

    # --- routing ---------------------------------------------------------------------------------------

    async def route(self, mb: int, frame: bytes) -> None:
        """Send micro-batch `mb`'s activation frame to a worker of the next stage (`pick_worker`); kept
        until its gradient is back, to go to another worker if this one is lost. A share of them goes to
        a second worker too (`Audit`)."""
        audit = self.audits.get(mb)
        while True:
            links = self.live(self.downs)
            if not links:
                raise ChainBroken("every worker of the next stage is gone")
            if self._answer_from_spare(mb, frame):
                return
            taken = self.sent_to.get(mb, set())
            free = [k for k in links if k.peer not in taken]
            if not free:  # each live worker had it: a copy still out there becomes its route
                if audit is not None and any(not self.downs[p].lost for p in audit.waiting):
                    self._route_to_copy(mb, audit)
                    return
                free = [k for k in links if not self.step_cap or k.served < self.step_cap]
                if not free:  # again to one of them, which then steps on it twice, if under its cap
                    raise ChainBroken(f"micro-batch {mb} went to every worker left of the next stage")
            links = free
            loads = [WorkerLoad(k.peer, k.served, self._queue(k), k.service.per_mb_s) for k in links]
            link = self.downs[pick_worker(loads)]
            self.routed[mb] = Routed(link, frame, time.monotonic(), self._queue(link) + 1)
            log.debug("micro-batch %d -> %s (%d in flight there)", mb, link.peer[-8:], self.routed[mb].queue)
            link.served += 1
            self.sent_to.setdefault(mb, set()).add(link.peer)
            if await self.send(link, frame):
                drawn = self.audit_share > 0 and self._draw.random() < self.audit_share
                if audit is None and drawn and len(self.live(self.downs)) > 1:
                    self.audits[mb] = Audit(frame, [link.peer])
                    await self.ask_another(mb)
                return
            # lost: `lose` sent it on already, unless it was our last worker downstream (raised there)
            if mb not in self.routed or self.routed[mb].link is not link:
                return

    def _queue(self, link: Link) -> int:
        return sum(1 for r in self.routed.values() if r.link is link)

    # --- second opinions ---------------------------------------------------------------------------------

    async def ask_another(self, mb: int) -> bool:
        """Send audited `mb` to a live worker not asked yet, the least loaded (False: none is left)."""
        audit = self.audits[mb]
        while True:
            others = [
                k
                for k in self.live(self.downs)
                if k.peer not in audit.asked and (not self.step_cap or k.served < self.step_cap)
            ]
            if not others:
                if not audit.waiting:
                    del self.audits[mb]
                return False
            link = min(others, key=lambda k: (self._queue(k), k.peer))
            audit.asked.append(link.peer)
            self.sent_to.setdefault(mb, set()).add(link.peer)
            link.served += 1  # its end frame counts the copy: to the worker it is one more micro-batch
            if await self.send(link, audit.frame):
                self.copies += 1
                log.debug("micro-batch %d also -> %s (a second opinion)", mb, link.peer[-8:])
                return True

    async def ask_about(self, mb: int, frame: bytes, peer: str) -> bool:
        """A second opinion on `mb`, which `peer` answered with a gradient far off the pool's (False: no other
        worker is left to ask)."""
        if mb in self.audits:
            return True  # drawn for one already
        self.audits[mb] = Audit(frame, [peer])
        if await self.ask_another(mb):
            return True
        self.audits.pop(mb, None)
        return False

    def is_copy(self, mb: int, link: Link) -> bool:
        """Whether a gradient for `mb` on `link` answers a copy we sent for a second opinion."""
        audit = self.audits.get(mb)
        routed = self.routed.get(mb)
        asked = audit is not None and link.peer in audit.waiting
        return asked and (routed is None or routed.link is not link)

    def _route_to_copy(self, mb: int, audit: Audit) -> None:
        """Re-routing `mb`, whose only live workers hold its copy: that copy's gradient is its answer."""
        peer = next(p for p in audit.waiting if not self.downs[p].lost)
        link = self.downs[peer]
        audit.asked.remove(peer)
        self.routed[mb] = Routed(link, audit.frame, time.monotonic(), self._queue(link) + 1)
        if not audit.waiting:
            del self.audits[mb]

    def _answer_from_spare(self, mb: int, frame: bytes) -> bool:
        """Answer re-routed `mb` with the gradient a live worker already sent for its copy (True)."""
        spare = self.spare_answers.pop(mb, None)
        if spare is None or self.downs[spare[0]].lost or self.on_spare_answer is None:
            return False
        link = self.downs[spare[0]]
        self.routed[mb] = Routed(link, frame, time.monotonic(), self._queue(link) + 1, timed=False)
        log.debug("micro-batch %d answered by %s's gradient for its copy", mb, link.peer[-8:])
        self.on_spare_answer(mb, link, spare[1])
        return True

    def _void_audits(self, link: Link) -> None:
        """`link` is lost: the second opinions it was part of cannot be judged (their copies still out are
        taken and dropped; a copy's gradient already here is kept if `link` held the micro-batch's route,
        to answer it: `_answer_from_spare`)."""
        for mb, audit in list(self.audits.items()):
            if link.peer in audit.asked:
                audit.void = True
                audit.asked.remove(link.peer)
                audit.grads.pop(link.peer, None)
                routed = self.routed.get(mb)
                if routed is not None and routed.link is link:
                    kept = [(p, g) for p, g in audit.grads.items() if not self.downs[p].lost]
                    if kept:
                        self.spare_answers[mb] = kept[0]
                if not audit.waiting:
                    del self.audits[mb]

    def expects(self, mb: int, link: Link) -> bool:
        """Whether a gradient for `mb` may come back on `link` (it went down there and is not back)."""
        routed = self.routed.get(mb)
        return routed is not None and routed.link is link

    def answered(self, mb: int) -> Routed:
        """`mb`'s gradient came back: its round trip is learned and it is forgotten here (what was sent is
        handed back, to send again should the gradient be refused)."""
        routed = self.routed.pop(mb)
        link = routed.link
        link.answered += 1
        if link.answered > 1 and routed.timed:  # a round's first answer waits for the round to open there
            link.service.observe(time.monotonic() - routed.sent_at, routed.queue)
        log.debug(
            "micro-batch %d back from %s in %.2f s", mb, link.peer[-8:], time.monotonic() - routed.sent_at
        )
        return routed

    # --- sending, receiving --------------------------------------------------------------------------

    async def send(self, link: Link, data: bytes) -> bool:
        """Write a frame to `link`; False when the link is lost (or just broke, and was lost now)."""
        if link.lost:
            return False
        started = time.perf_counter()
        try:
            await write_frame(link.stream.writer, data, frame_write_timeout_s(len(data), self.up_mbps()))
        except (TimeoutError, ConnectionError, OSError) as exc:
            await self.lose(link, f"stream to {link.peer[-8:]} broke ({type(exc).__name__})")
            return False
        self.bytes_sent += len(data)
        self.send_s += time.perf_counter() - started
        return True

    async def receive(self, link: Link, max_bytes: int) -> bytes:
        """The next frame on `link` (no timeout: between rounds a neighbour is silent while the seal is
        pending; a dead one is noticed by the stream closing or by the chain's watch)."""
        try:
            data = await read_frame(link.stream.reader, max_bytes, timeout=None)
        except (asyncio.IncompleteReadError, ConnectionError, OSError) as exc:
            raise LinkFailed(f"stream from {link.peer[-8:]} ended ({type(exc).__name__})") from None
        except WireError as exc:
            raise LinkFailed(f"bad frame from {link.peer[-8:]}: {exc}") from None
        self.bytes_received += len(data)
        return data

    # --- losing links --------------------------------------------------------------------------------

    async def lose(self, link: Link, reason: str, blame: bool = False) -> None:
        """`link` is gone (its stream broke, its worker left or was caught lying: `blame`). Its micro-batches
        in flight go to another worker of its pool; ChainBroken when none of the pool is left."""
        if link.lost:
            return
        link.lost = True
        link.stream.close()
        side = "next" if link.peer in self.downs and self.downs[link.peer] is link else "previous"
        links = self.downs if side == "next" else self.ups
        if blame:
            log.warning(
                "chain %s: %s sent what no honest stage sends: %s", self.layout.chain, link.peer, reason
            )
            if self.blamed is None:
                self.blamed = link.peer
                await self.on_blame(link.peer, reason)
        if not self.live(links):
            raise ChainBroken(reason, link.peer if blame else None)
        log.warning(
            "chain %s: lost %s of the %s stage (%s); %d of its workers left",
            self.layout.chain,
            link.peer[-8:],
            side,
            reason,
            len(self.live(links)),
        )
        if side == "next":
            self._void_audits(link)
        if self.on_lost is not None:
            self.on_lost(link)
        if side == "next":
            for mb in sorted(mb for mb, r in self.routed.items() if r.link is link):
                routed = self.routed.get(mb)
                if routed is None or routed.link is not link:  # sent on meanwhile (a nested loss)
                    continue
                log.info("chain %s: micro-batch %d goes to another worker", self.layout.chain, mb)
                await self.route(mb, routed.frame)

    async def drop_gone(self, view: SwarmView) -> None:
        """Lose the links to neighbours the records no longer count as working in our chain (left, say
        their training ended, or caught lying by another member)."""
        status = next((c for c in view.chains() if c.chain == self.layout.chain), None)
        working = {p for workers in status.workers for p in workers} if status is not None else set()
        for link in [*self.live(self.downs), *self.live(self.ups)]:
            if link.peer not in working:
                await self.lose(link, f"{link.peer[-8:]} no longer works in the chain, as the records say")
