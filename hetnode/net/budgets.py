"""Budgets on what strangers may make a daemon do (docs/security.md, "Exhaust a daemon"), as nested scopes:
global, then per peer.

Identities are free, so every budget has a per-peer scope (one identity cannot take it all) *and* a global
scope (many identities cannot take more than the node can give). Shaped after go-libp2p's resource
manager (`p2p/host/resource-manager/scope.go`), but small:

- `StreamScope`: concurrent streams. A handler reserves a slot before it reads anything and releases it
  when the stream ends; a refusal costs one dict lookup. Some slots are kept for preferred peers (the
  coordinator, the replicas of recent seals): strangers together cannot fill them, so a crowd of idle
  identities cannot keep the sealer from fetching an honest replica's payload.
- `ByteBudget`: bytes served per minute on one channel ("probe", "payload", "state"), as token buckets
  charged before the bytes are sent.
- `Budgets`: the node's live scopes built from one frozen `NodeBudgets`, with a count of refusals.

Pure logic with an injectable clock: no sockets, no asyncio.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal

from hetnode.errors import HetnodeError

Channel = Literal["probe", "payload", "state"]
CHANNELS: tuple[Channel, ...] = ("probe", "payload", "state")
Scope = Literal["peer", "global"]
Clock = Callable[[], float]
MiB = 2**20
MAX_TRACKED_PEERS = 10_000  # per-peer state kept; beyond it the idle peers are forgotten first


class Refused(HetnodeError):
    """A request the node will not serve now; `code` is the error reply's code ("budget", "busy", ...)."""

    def __init__(self, code: str, reason: str) -> None:
        self.code = code
        self.reason = reason
        super().__init__(reason)


@dataclass(frozen=True)
class NodeBudgets:
    """Per-peer and global limits of one daemon. The defaults fit 4 MiB probes and 64 MiB frames;
    `NodeBudgets.sized` derives them from a config's probe size and frame limit.

    Byte budgets are per minute and also the burst: a token bucket holds at most one minute's worth, so
    each must be at least the largest single reply (a frame), or that reply could never be served."""

    # streams in flight: a daemon talks to a peer over one or two streams at a time (a payload fetch,
    # a probe, a nudge); 8 leaves room for overlap, 256 bounds the work all strangers together can start
    streams_per_peer: int = 8
    streams_global: int = 256
    streams_preferred: int = 64  # of the global slots, kept for preferred peers (strangers share the rest)
    # chain-stage streams live as long as a chain: a stage has one upstream, a few cover a reconnect
    stage_streams_per_peer: int = 2
    stage_streams_global: int = 8
    # one probe = probe_bytes up + probe_bytes down; two probes a minute per peer lets one retry
    probe_bytes_per_peer: int = 16 * MiB
    probe_bytes_global: int = 256 * MiB  # 16 peers' worth a minute: ~4.5 MB/s at most, on average
    # a replica fetches a round's payloads for its shards from a sealer: compressed, ~1% of dense θ
    payload_bytes_per_peer: int = 8 * 64 * MiB
    payload_bytes_global: int = 64 * 64 * MiB
    # a catch-up fetches every shard of dense θ and restarts from scratch when one fails, so a peer's
    # burst must hold all of θ (the 1b config's θ is 8 frames)
    state_bytes_per_peer: int = 16 * 64 * MiB
    state_bytes_global: int = 64 * 64 * MiB

    @classmethod
    def sized(cls, probe_bytes: int, max_frame_bytes: int) -> NodeBudgets:
        """The default shape for a config's probe size (bytes each way) and frame limit."""
        return cls(
            probe_bytes_per_peer=4 * probe_bytes,
            probe_bytes_global=64 * probe_bytes,
            payload_bytes_per_peer=8 * max_frame_bytes,
            payload_bytes_global=64 * max_frame_bytes,
            state_bytes_per_peer=16 * max_frame_bytes,
            state_bytes_global=64 * max_frame_bytes,
        )

    def __post_init__(self) -> None:
        if not 0 <= self.streams_preferred < self.streams_global:
            raise ValueError(
                f"streams_preferred ({self.streams_preferred}) must leave strangers some of the "
                f"{self.streams_global} stream slots"
            )

    def bytes_per_minute(self, channel: Channel) -> tuple[int, int]:
        """(per peer, global) bytes a minute of `channel`."""
        return getattr(self, f"{channel}_bytes_per_peer"), getattr(self, f"{channel}_bytes_global")


class Reservation:
    """One stream slot; `release()` (or leaving a `with` block) gives it back, once."""

    def __init__(self, scope: StreamScope, peer: str) -> None:
        self._scope: StreamScope | None = scope
        self.peer = peer

    def release(self) -> None:
        if self._scope is not None:
            self._scope._release(self.peer)
            self._scope = None

    def __enter__(self) -> Reservation:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


class StreamScope:
    """Concurrent streams, per peer and in total: reserve before any work, release when done."""

    def __init__(self, per_peer: int, total: int, preferred: int = 0) -> None:
        self.per_peer = per_peer
        self.total = total
        self.preferred = preferred  # slots only preferred peers may take
        self.in_use = 0
        self.others_in_use = 0  # slots held by peers that are not preferred
        self._by_peer: Counter[str] = Counter()
        self._others: Counter[str] = Counter()  # per peer: of its slots, those taken while not preferred

    def reserve(self, peer: str, preferred: bool = False) -> Reservation | None:
        """A slot for `peer`, or None when the peer or the node is at its limit (for a peer that is not
        preferred: the slots left to others)."""
        if self.in_use >= self.total or self._by_peer[peer] >= self.per_peer:
            return None
        if not preferred and self.others_in_use >= self.total - self.preferred:
            return None
        self.in_use += 1
        self._by_peer[peer] += 1
        if not preferred:
            self.others_in_use += 1
            self._others[peer] += 1
        return Reservation(self, peer)

    def refused_by(self, peer: str) -> Scope:
        """Which limit a refused `reserve(peer)` hit (for the log)."""
        return "peer" if self._by_peer[peer] >= self.per_peer else "global"

    def held_by(self, peer: str) -> int:
        return self._by_peer[peer]

    def _release(self, peer: str) -> None:
        self.in_use -= 1
        self._by_peer[peer] -= 1
        if self._by_peer[peer] <= 0:
            del self._by_peer[peer]  # no entry for peers with nothing open: the dict stays small
        if self._others[peer] > 0:
            self.others_in_use -= 1
            self._others[peer] -= 1
            if self._others[peer] <= 0:
                del self._others[peer]


@dataclass
class TokenBucket:
    """`capacity` tokens, refilled continuously at `capacity` per `period_s`."""

    capacity: float
    period_s: float
    now: float
    tokens: float = field(init=False)

    def __post_init__(self) -> None:
        self.tokens = self.capacity

    def refill(self, now: float) -> None:
        elapsed = max(0.0, now - self.now)
        self.tokens = min(self.capacity, self.tokens + elapsed * self.capacity / self.period_s)
        self.now = now

    def full(self) -> bool:
        return self.tokens >= self.capacity


class ByteBudget:
    """Bytes a minute on one channel, per peer and global; a charge takes from both or from neither."""

    def __init__(
        self, per_peer: int, total: int, clock: Clock = time.monotonic, period_s: float = 60.0
    ) -> None:
        self.per_peer = per_peer
        self.clock = clock
        self.period_s = period_s
        self._global = TokenBucket(float(total), period_s, clock())
        self._peers: dict[str, TokenBucket] = {}

    def charge(self, peer: str, n_bytes: int) -> Scope | None:
        """Take `n_bytes` for `peer`; None when taken, else the scope that has not enough left."""
        now = self.clock()
        bucket = self._peers.get(peer)
        if bucket is None:
            bucket = self._peers[peer] = TokenBucket(float(self.per_peer), self.period_s, now)
            self._forget_idle()
        bucket.refill(now)
        self._global.refill(now)
        if bucket.tokens < n_bytes:
            return "peer"
        if self._global.tokens < n_bytes:
            return "global"
        bucket.tokens -= n_bytes
        self._global.tokens -= n_bytes
        return None

    def resize(self, per_peer: int, total: int) -> None:
        """New limits; what is left now is kept, up to the new capacity."""
        self.per_peer = per_peer
        self._global.capacity = float(total)
        self._global.tokens = min(self._global.tokens, float(total))
        for bucket in self._peers.values():
            bucket.capacity = float(per_peer)
            bucket.tokens = min(bucket.tokens, float(per_peer))

    def left(self, peer: str) -> tuple[float, float]:
        """(peer, global) bytes that could be charged now."""
        now = self.clock()
        self._global.refill(now)
        bucket = self._peers.get(peer)
        if bucket is None:
            return float(self.per_peer), self._global.tokens
        bucket.refill(now)
        return bucket.tokens, self._global.tokens

    def _forget_idle(self) -> None:
        # a forgotten peer starts again with a full bucket, which a full bucket already is: drop those
        # first; only then the least recently charged (the global bucket still bounds them all)
        if len(self._peers) <= MAX_TRACKED_PEERS:
            return
        now = self.clock()
        for peer, bucket in list(self._peers.items()):
            bucket.refill(now)
            if bucket.full():
                del self._peers[peer]
        if len(self._peers) > MAX_TRACKED_PEERS:
            oldest = sorted(self._peers, key=lambda p: self._peers[p].now)
            for peer in oldest[: len(self._peers) - MAX_TRACKED_PEERS // 2]:
                del self._peers[peer]


class Budgets:
    """A node's live budgets: stream scopes, byte budgets per channel, and refusal counts."""

    def __init__(self, limits: NodeBudgets, clock: Clock = time.monotonic) -> None:
        self.limits = limits
        self.streams = StreamScope(limits.streams_per_peer, limits.streams_global, limits.streams_preferred)
        self.stage_streams = StreamScope(limits.stage_streams_per_peer, limits.stage_streams_global)
        self.bytes: dict[Channel, ByteBudget] = {
            channel: ByteBudget(*limits.bytes_per_minute(channel), clock=clock) for channel in CHANNELS
        }
        # by reason, e.g. "busy", "rate_limited", "budget:state", "policy:probe" (for the metrics)
        self.refusals: Counter[str] = Counter()

    def reconfigure(self, limits: NodeBudgets) -> None:
        """Apply new limits in place: streams open now keep their slots, buckets keep what is left."""
        self.limits = limits
        self.streams.per_peer, self.streams.total = limits.streams_per_peer, limits.streams_global
        self.streams.preferred = limits.streams_preferred
        self.stage_streams.per_peer = limits.stage_streams_per_peer
        self.stage_streams.total = limits.stage_streams_global
        for channel, budget in self.bytes.items():
            budget.resize(*limits.bytes_per_minute(channel))

    def spend(self, channel: Channel, peer: str, n_bytes: int) -> None:
        """Charge `n_bytes` of `channel` to `peer`, or raise `Refused` (code "budget") and charge nothing."""
        scope = self.bytes[channel].charge(peer, n_bytes)
        if scope is not None:
            self.refusals[f"budget:{channel}"] += 1
            per_peer, total = self.limits.bytes_per_minute(channel)
            limit = per_peer if scope == "peer" else total
            raise Refused(
                "budget", f"{channel} budget ({scope}, {limit} bytes a minute) cannot cover {n_bytes} bytes"
            )
