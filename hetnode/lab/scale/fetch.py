"""The sealed fetch as the daemon paces it, per peer, for `hetnode bench scale`'s `any-holder` rows.

The fluid `any-holder` schedule (`scale_schedules.py`) lets every author serve all its fetchers at once:
the implemented schedule's balanced limit. `fetch_sealed` (`hetnode/daemon/payload_fetch.py`) paces it:
- a batch is everything a fetcher still wants from one holder, on one stream; payloads (shards) arrive one
  after another, and a fetcher keeps a batch's payloads only once the whole batch has come in;
- a fetcher keeps at most MAX_PARALLEL_HOLDERS batches in flight, one per holder; a freed slot goes at
  once to the waiting holder that ranks first in the fetcher's own order (`launch_rank`);
- a batch fails when no payload of it arrives for STALL_TIMEOUT_S (from its request, then from each
  payload). The holder is passed over for the round and the whole batch, what came in included, goes to
  the payloads' next candidate: at seal time nobody has applied the round, so that is the sealer, asked
  like any other holder. If the sealer stalls too, the fetch fails (`PayloadsUnavailable`).

Played out per peer: every anchor and every chain stage is a fetcher and a holder of its own, with seeded
peer ids ranked by the daemon's own `launch_rank`. As in the fluid model, each batch is one connection whose
bytes flow one RTT after its request, every peer's uplink and downlink are shared max-min fairly per
connection (`fair_rates`), and everyone starts when the last peer has read the seal. With `quantum_s` = 0
that is exact; the stall clock starts at the request, where the daemon's starts once the stream is open.
With `quantum_s` > 0 (what `hetnode bench scale` uses: QUANTUM_OF_LIMIT of the round's limit), rates are
recomputed at most that often, so a batch may wait up to a quantum for its first byte and bandwidth a
batch frees may idle up to a quantum; events further apart than that stay exact. docs/scale.md measures
what the quantum costs.
"""

from __future__ import annotations

import random
from bisect import bisect_right
from collections.abc import Mapping
from dataclasses import dataclass, field
from itertools import accumulate

import numpy as np

from hetnode.lab.scale.schedules import MBIT, Links, Swarm
from hetnode.lab.scale.sizes import ROUND, PayloadSizes
from hetnode.planning.fetch import MAX_PARALLEL_HOLDERS, STALL_TIMEOUT_S, launch_rank

PEER_ID_SEED = 0
# `hetnode bench scale`'s quantum, as a share of the balanced round's limit: a few thousand rate
# recomputations per row, whatever R (docs/scale.md measures what that costs against the exact model)
QUANTUM_OF_LIMIT = 1 / 4000
SEALER = 0  # peer index of the coordinator; anchors follow, then chain c's stage s at 1 + A + c·S + s
_EPS_S = 1e-9


@dataclass
class DaemonFetch:
    """The post-seal fetch of every class (the anchors; stage s of every chain), from the first request."""

    fetch_s: dict[str, float]  # per class: until its slowest fetcher had every payload
    requests: int  # batches launched, the sealer's included
    timed_out: int  # batches that stalled, the sealer's included
    fallback_bytes: float  # what the sealer sent
    wasted_bytes: dict[str, float]  # per class: bytes of batches that then stalled (all fetched again)
    failed: bool  # some fetcher's batch to the sealer stalled too: it cannot apply the round by fetching
    holder_upload_bytes: dict[str, float] = field(default_factory=dict)  # per holder class
    most_downloaded: dict[str, float] = field(default_factory=dict)  # per class: one fetcher's most bytes in
    rate_updates: int = 0  # fair-share computations: the model's cost

    @property
    def makespan_s(self) -> float:
        return max(self.fetch_s.values(), default=0.0)


def fair_rates(src: np.ndarray, dst: np.ndarray, up: np.ndarray, down: np.ndarray) -> np.ndarray:
    """Bytes/s of each connection src[i] → dst[i] (peer indices), max-min fair per connection on every
    peer's uplink `up` and downlink `down`.

    Parallel water-filling: a link whose fair share (slack over its unsettled connections) is no larger
    than that of any other link its connections cross is their bottleneck, since shares only rise as
    others settle; all such links settle at once. Each pass settles at least the smallest share, so this
    is progressive filling's answer in a handful of passes rather than one per distinct share."""
    rate = np.zeros(len(src))
    left = np.arange(len(src))
    s, d = src, dst
    slack_up, slack_down = up.astype(float), down.astype(float)
    n = len(up)
    while left.size:
        share_up = slack_up / np.maximum(np.bincount(s, minlength=n), 1)
        share_down = slack_down / np.maximum(np.bincount(d, minlength=n), 1)
        a, b = share_up[s], share_down[d]
        at_up = (np.bincount(s, weights=b < a, minlength=n) == 0)[s]
        at_down = (np.bincount(d, weights=a < b, minlength=n) == 0)[d]
        settled = at_up | at_down
        r = np.where(at_up, a, b)[settled]
        rate[left[settled]] = r
        slack_up -= np.bincount(s[settled], weights=r, minlength=n)
        slack_down -= np.bincount(d[settled], weights=r, minlength=n)
        keep = ~settled
        left, s, d = left[keep], s[keep], d[keep]
    return rate


@dataclass
class _Peers:
    klass: list[str]  # "coordinator", "anchors" or f"stage{s}"
    up: np.ndarray  # bytes/s
    down: np.ndarray
    wants: list[dict[int, list[int]]]  # per fetcher: {holder: the payload sizes it fetches from it}
    order: list[list[int]]  # per fetcher: its holders and the sealer, by launch_rank


def _peers(sizes: PayloadSizes, swarm: Swarm, links: Links, seed: int) -> _Peers:
    a, c, stages = swarm.anchors, swarm.chains, swarm.stages if swarm.chains else 0
    rng = random.Random(seed)
    ids = [f"12D3KooW{rng.getrandbits(190):048x}" for _ in range(1 + a + c * stages)]
    klass = ["coordinator"] + ["anchors"] * a + [f"stage{s}" for _ in range(c) for s in range(stages)]
    rate = {"coordinator": links.coordinator_mbit, "anchors": links.anchor_mbit}
    up = np.array([rate.get(k, links.stage_mbit) * MBIT for k in klass])
    everything = list(sizes.shard_bytes.values())
    slices = [[sizes.shard_bytes[x] for x in sizes.stage_shards[s]] for s in range(stages)]
    anchors = range(1, 1 + a)
    stage_peers = [(1 + a + i * stages + s, s) for i in range(c) for s in range(stages)]
    wants: list[dict[int, list[int]]] = [{}]
    for f in anchors:
        wants.append({h: everything for h in anchors if h != f} | {h: slices[s] for h, s in stage_peers})
    for f, stage in stage_peers:
        mine = slices[stage]
        wants.append({h: mine for h in anchors} | {h: mine for h, s in stage_peers if s == stage and h != f})
    order = [
        sorted([SEALER, *want], key=lambda h, f=f: launch_rank(ids[f], ROUND, ids[h]))
        for f, want in enumerate(wants)
    ]
    return _Peers(klass, up, up.copy(), wants, order)


class _Fetch:
    """Every fetcher's batches, slot by slot: slot i of fetcher f is row f·k + i of the arrays (k: the most
    slots any fetcher has)."""

    def __init__(
        self, peers: _Peers, rtt_s: float, stall_s: float, quantum_s: float, slots: list[int]
    ) -> None:
        self.p, self.rtt, self.stall, self.quantum, self.k = peers, rtt_s, stall_s, quantum_s, max(slots)
        n = len(peers.klass) * self.k
        self.busy = np.zeros(n, bool)
        self.flowing = np.zeros(n, bool)
        self.holder = np.zeros(n, int)
        self.fetcher = np.arange(n) // self.k
        self.launch_t, self.last_t = np.zeros(n), np.zeros(n)  # request; last payload (stall clock)
        self.sent, self.total, self.rate = np.zeros(n), np.zeros(n), np.zeros(n)
        self.next_b = np.full(n, np.inf)  # bytes in at which the next payload is complete
        self.later_max = np.zeros(n)  # the largest payload after the next one
        self.batch: list[list[int]] = [[] for _ in range(n)]  # payload sizes
        self.ends: list[list[int]] = [[] for _ in range(n)]  # bytes in at which each payload is complete
        self.later: list[list[int]] = [[] for _ in range(n)]  # the largest payload after each one
        self.done_in = [0] * n  # payloads complete
        self.free = [list(range(f * self.k, f * self.k + mine)) for f, mine in enumerate(slots)]
        self.shapes: dict[int, tuple[list[int], list[int]]] = {}  # id of a `wants` list -> (ends, later)
        self.ptr = [0] * len(peers.klass)  # next holder of `order` to launch (the sealer skipped)
        self.sealer_at = [order.index(SEALER) for order in peers.order]
        self.to_sealer: list[list[int]] = [[] for _ in peers.klass]
        self.sealer_busy = [False] * len(peers.klass)
        self.sealer_avoided = [False] * len(peers.klass)
        self.dead = [False] * len(peers.klass)
        self.finish = [0.0] * len(peers.klass)
        self.received = [0.0] * len(peers.klass)
        self.now, self.dirty, self.updates = 0.0, False, 0
        self.requests = self.timed_out = 0
        self.wasted: dict[str, float] = {}
        self.uploads: dict[str, float] = {}

    def run(self) -> DaemonFetch:
        for f in range(1, len(self.p.klass)):
            self._fill(f)
        while self.busy.any():
            if self.dirty:
                live = np.flatnonzero(self.flowing)
                self.rate[:] = 0.0
                self.rate[live] = fair_rates(self.holder[live], self.fetcher[live], self.p.up, self.p.down)
                self.dirty, self.updates = False, self.updates + 1
            nxt = self._next_event()
            self._advance(nxt if self.quantum <= 0 else max(nxt, self.now + self.quantum))
        classes = sorted(set(self.p.klass[1:]))
        fetchers = range(1, len(self.p.klass))
        return DaemonFetch(
            fetch_s={
                k: float(max(self.finish[f] for f in fetchers if self.p.klass[f] == k)) for k in classes
            },
            requests=self.requests,
            timed_out=self.timed_out,
            fallback_bytes=self.uploads.get("coordinator", 0.0),
            wasted_bytes={k: self.wasted.get(k, 0.0) for k in classes},
            failed=any(self.dead),
            holder_upload_bytes=self.uploads,
            most_downloaded={
                k: max(self.received[f] for f in fetchers if self.p.klass[f] == k) for k in classes
            },
            rate_updates=self.updates,
        )

    def _next_event(self) -> float:
        """The first request whose bytes start to flow, batch that completes or stalls, or payload after
        which a later one would stall at today's rates (its stall clock must then be looked at again)."""
        moving = self.flowing & (self.rate > 0)
        with np.errstate(divide="ignore", invalid="ignore"):
            rate = np.where(moving, self.rate, np.nan)
            payload = np.where(moving, self.now + (self.next_b - self.sent) / rate, np.inf)
            slow_later = moving & (self.later_max / rate > self.stall)
        stall = np.where(self.busy, self.last_t + self.stall, np.inf)
        starts = np.where(self.busy & ~self.flowing, self.launch_t + self.rtt, np.inf)
        ends = np.where(payload > stall, stall, np.where(slow_later, payload, np.inf))
        done = np.where(moving, self.now + (self.total - self.sent) / np.where(moving, self.rate, 1), np.inf)
        return float(min(starts.min(), ends.min(), done.min()))

    def _advance(self, until: float) -> None:
        """Move every batch on to `until` at today's rates; take what completes or stalls on the way, in
        time order (ties together, as the daemon's `asyncio.wait` returns them), and relaunch."""
        moving = np.flatnonzero(self.flowing & (self.rate > 0))
        arrive = self.now + (self.next_b[moving] - self.sent[moving]) / self.rate[moving]
        stall_at = self.last_t[moving] + self.stall
        stalls = (arrive > stall_at + _EPS_S) & (stall_at <= until + _EPS_S)
        stop = np.where(stalls, stall_at, until)
        before = self.sent.copy()
        self.sent[moving] = np.minimum(
            self.total[moving], before[moving] + self.rate[moving] * (stop - self.now)
        )
        events: list[tuple[float, int, bool]] = []  # (time, slot, stalled)
        crossed = moving[self.sent[moving] >= self.next_b[moving] * (1 - 1e-12) - 1e-6]
        for slot in crossed.tolist():
            if self._payloads_in(slot, float(before[slot])):
                events.append((self.last_t[slot], slot, False))
        idle = np.flatnonzero(self.busy & ~self.flowing & (self.launch_t + self.stall <= until + _EPS_S))
        events += [
            (t, s, True) for t, s in zip(stall_at[stalls].tolist(), moving[stalls].tolist(), strict=True)
        ]
        events += [(self.launch_t[s] + self.stall, s, True) for s in idle.tolist()]
        events.sort()
        i = 0
        while i < len(events):
            at, group = events[i][0], []
            while i < len(events) and events[i][0] <= at + _EPS_S:
                group.append(events[i])
                i += 1
            self.now = at
            for _, slot, stalled in group:
                self._take(slot, stalled)
            for f in sorted({slot // self.k for _, slot, _ in group}):
                self._fill(f)
        self.now = until
        starting = self.busy & ~self.flowing & (self.launch_t + self.rtt <= until + _EPS_S)
        if starting.any():
            self.flowing |= starting
            self.dirty = True

    def _payloads_in(self, slot: int, before: float) -> bool:
        """Count the payloads of `slot` complete once its bytes went from `before` (at `self.now`) to
        `sent`, and when the last of them arrived; True when that is all of them."""
        ends = self.ends[slot]
        k = max(self.done_in[slot] + 1, bisect_right(ends, float(self.sent[slot]) * (1 + 1e-12) + 1e-6))
        self.done_in[slot] = k
        self.last_t[slot] = self.now + (ends[k - 1] - before) / self.rate[slot]
        if k == len(ends):
            return True
        self.next_b[slot], self.later_max[slot] = ends[k], self.later[slot][k]
        return False

    def _take(self, slot: int, stalled: bool) -> None:
        """A batch ended: keep its payloads, or pass its holder over and send them all to the sealer."""
        if not self.busy[slot]:  # dropped when its fetcher failed
            return
        f, h, got = slot // self.k, int(self.holder[slot]), float(self.sent[slot])
        self.busy[slot] = self.flowing[slot] = False
        self.rate[slot] = 0.0
        self.free[f].append(slot)
        self.dirty = True
        self.uploads[self.p.klass[h]] = self.uploads.get(self.p.klass[h], 0.0) + got
        self.received[f] += got
        if h == SEALER:
            self.sealer_busy[f] = False
        if not stalled:
            self.finish[f] = max(self.finish[f], self.now)
            return
        self.timed_out += 1
        self.wasted[self.p.klass[f]] = self.wasted.get(self.p.klass[f], 0.0) + got
        if h == SEALER:
            self.sealer_avoided[f] = True
        self.to_sealer[f] += self.batch[slot]
        if self.sealer_avoided[f]:  # no candidate left: the fetch fails, its other batches are dropped
            self.dead[f] = True
            for other in range(f * self.k, f * self.k + self.k):
                if self.busy[other]:
                    self.busy[other] = self.flowing[other] = False
                    self.rate[other] = 0.0

    def _fill(self, f: int) -> None:
        """Launch batches into `f`'s free slots, each to the waiting holder first in f's own order."""
        order, free = self.p.order[f], self.free[f]
        while free and not self.dead[f]:
            while self.ptr[f] < len(order) and order[self.ptr[f]] == SEALER:
                self.ptr[f] += 1
            sealer_ready = self.to_sealer[f] and not self.sealer_busy[f]
            ahead = self.ptr[f] >= len(order) or self.sealer_at[f] < self.ptr[f]
            if sealer_ready and ahead:
                h, sizes = SEALER, self.to_sealer[f]
                self.to_sealer[f], self.sealer_busy[f] = [], True
            elif self.ptr[f] < len(order):
                h = order[self.ptr[f]]
                sizes = self.p.wants[f][h]
                self.ptr[f] += 1
            else:
                return
            if h == SEALER:
                ends, later = _shape(sizes)
            else:  # `wants` shares a few lists between all fetchers: shaped once each
                if id(sizes) not in self.shapes:
                    self.shapes[id(sizes)] = _shape(sizes)
                ends, later = self.shapes[id(sizes)]
            slot = free.pop()
            self.busy[slot], self.flowing[slot], self.holder[slot] = True, False, h
            self.launch_t[slot] = self.last_t[slot] = self.now
            self.sent[slot], self.total[slot], self.rate[slot] = 0.0, float(ends[-1]), 0.0
            self.batch[slot], self.ends[slot], self.later[slot], self.done_in[slot] = sizes, ends, later, 0
            self.next_b[slot], self.later_max[slot] = ends[0], later[0]
            self.requests += 1


def _shape(sizes: list[int]) -> tuple[list[int], list[int]]:
    """A batch's payload ends (bytes in) and, for each payload, the largest one after it."""
    later, biggest = [0] * len(sizes), 0
    for k in range(len(sizes) - 1, -1, -1):
        later[k], biggest = biggest, max(biggest, sizes[k])
    return list(accumulate(sizes)), later


def daemon_fetch(
    sizes: PayloadSizes,
    swarm: Swarm,
    links: Links,
    seed: int = PEER_ID_SEED,
    quantum_s: float = 0.0,
    stall_s: float = STALL_TIMEOUT_S,
    slots: int | Mapping[str, int] = MAX_PARALLEL_HOLDERS,
) -> DaemonFetch:
    """Every fetcher's fetch of the sealed payloads, from t = 0 (all have read the seal) to the end.

    `stall_s` and `slots` (batches in flight, for every fetcher or per class: "anchors", "stage0", ...)
    default to the daemon's constants; other values ask what a change to them would do."""
    peers = _peers(sizes, swarm, links, seed)
    per_class = slots if isinstance(slots, Mapping) else {}
    default = MAX_PARALLEL_HOLDERS if isinstance(slots, Mapping) else slots
    mine = [per_class.get(k, default) for k in peers.klass]
    return _Fetch(peers, links.rtt_s, stall_s, quantum_s, mine).run()
