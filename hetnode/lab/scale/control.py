"""Control-plane bytes per peer per round, today and in the target scheme (docs/scale.md, docs/scale.md).

Control here means DHT records and their upkeep: peer records and heartbeats, announcements, polls of the
seal record beyond the one copy a replica needs, lookups and routing upkeep. Payloads and one copy of
the seal per replica are the sync plane (`hetnode/lab/scale/model.py`), never counted here.

Today (read from hetnode/service/presence.py, hetnode/protocol/view.py, hetnode/net/node.py,
hetnode/daemon/participant.py, bootstrap/round_keeper.py, before 5e90c12):
- every peer stores its whole record under the run's one `peers` key each heartbeat, and reads that key
  once per heartbeat (`RecentView`); a read of a dictionary key with `latest=True` walks a beam of k nodes
  and gets the whole dictionary, all N records, from each of the key's replicas it meets;
- every author stores an announcement; while it waits for the seal it reads the `seal` key every second
  (each read moves the whole previous seal until the new one is there); the coordinator reads the whole
  `announce` key every half second, all round long.
Since then (`stretched`): the same scheme, but in a stable swarm each peer stores and reads once per
`network.stable_heartbeat_s` (one read per daemon, shared by all its loops); the coordinator reads every
heartbeat. Still O(N) per peer: a read moves every record.
Target: per-peer keys; heartbeats every `stable_heartbeat_s` once a swarm is stable; a record holds what
changes on events only (per-round fields ride in the announcement, sent straight to the coordinator);
a change is pushed to the peers that depend on it (its chain) and read by nobody else; single-writer keys
are found by a plain Kademlia lookup (α parallel queries, O(log N) hops) that stops at the first copy.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import msgpack

# A DHT entry's owner subkey "[owner:<OpenSSH RSA-2048 key>]" (391 bytes in msgpack), its
# "[signature:<base64>]" (356) and its expiry (a float64)
RECORD_OVERHEAD_BYTES = 391 + 356 + 9
PEER_ID = "Q" * 46


@dataclass(frozen=True)
class ControlModel:
    round_period_s: float = 60.0  # control bytes are counted per round of this length
    heartbeat_s: float = 10.0  # configs' network.heartbeat_s
    stable_heartbeat_s: float = 120.0  # target, once the swarm is stable
    stretched_heartbeat_s: float = 60.0  # the code's, once the swarm is stable: network.stable_heartbeat_s
    seal_poll_s: float = 1.0  # hetnode/daemon/seal_wait.py POLL_S
    announce_poll_s: float = 0.5  # bootstrap/round_keeper.py POLL_S
    bucket_size: int = 20  # hivemind's k, also the beam of its lookups
    dht_replicas: int = 5  # hivemind's num_replicas
    alpha: int = 3  # target lookups: Kademlia's parallel queries
    rpc_bytes: int = 1200  # one DHT RPC without a value: request, k contacts back, framing
    event_rate: float = 0.02  # target: record changes per peer per round (joins, roles, chains)
    refresh_s: float = 3600.0  # target: each routing-table bucket refreshed by one lookup this often
    change_steps: int = 8  # the coordinator's change log keeps this many steps (records.py MAX_CHANGE_STEPS)
    change_log_bytes: int = 64 * 1024  # and drops its oldest to fit this (records.py MAX_RECORD_BYTES)
    change_step_peers: int = 64  # a step naming more peers is not logged (records.py MAX_STEP_PEERS)


@dataclass(frozen=True)
class RecordSizes:
    """Bytes of one stored entry (value and overhead), averaged over the swarm's anchors and stages."""

    peer_today: float  # the full record, per-round fields included
    peer_event: float  # the target's record: only what changes on events
    announce: float
    seal: float
    head: float = 0.0  # the coordinator's `head` entry: its round and the layer digests of θ


def record_sizes(
    shards: list[str], stage_shards: list[tuple[str, ...]], anchors: int, chains: int, seal: int
) -> RecordSizes:
    """Real msgpack sizes of records shaped as `hetnode/net/records.py` defines them."""

    def peer(held: tuple[str, ...] | list[str], stage: int | None, per_round: bool) -> int:
        record = {
            "name": "volunteer-0042",
            "link_class": "low" if stage is not None else "high",
            "up_mbps": 20.5,
            "down_mbps": 20.5,
            "rtt_ms": 48.5,
            "mem_gb": 24.0,
            "device": "cuda",
            "tflops": 80.5,
            "wants": "stage" if stage is not None else "anchor",
            "role": "stage" if stage is not None else "anchor",
            "chain": "b000123-c0042" if stage is not None else None,
            "stage": stage,
            "layers": [0, 2] if stage is not None else None,
            "chain_layout": [f"{PEER_ID}:0-2"] * len(stage_shards) if stage is not None else None,
            "admission": None,
            "version": 1,
        }
        if per_round:
            record |= {
                "outer_step": 1000,
                "last_seen": 1.7e9,
                "params_round": 1000,
                "layer_digests": {s: "0" * 16 for s in held},
                "tokens": 2**20,
            }
        return len(msgpack.packb(record, use_bin_type=True)) + RECORD_OVERHEAD_BYTES

    def announce(held: tuple[str, ...] | list[str]) -> int:
        body = {"round": 1000, "shards": {s: "0" * 64 for s in held}, "tokens": 2**20, "steps": 50}
        return len(msgpack.packb(body, use_bin_type=True)) + RECORD_OVERHEAD_BYTES

    members = [(shards, None)] * anchors + [
        (held, i) for _ in range(chains) for i, held in enumerate(stage_shards)
    ]

    def mean(size) -> float:
        return sum(size(held, stage) for held, stage in members) / len(members)

    head = {"round": 1000, "layer_digests": {s: "0" * 16 for s in shards}}
    return RecordSizes(
        peer_today=mean(lambda held, stage: peer(held, stage, True)),
        peer_event=mean(lambda held, stage: peer(held, stage, False)),
        announce=mean(lambda held, stage: announce(held)),
        seal=float(seal),
        head=float(len(msgpack.packb(head, use_bin_type=True)) + RECORD_OVERHEAD_BYTES),
    )


def lookup_rpcs_today(peers: int, m: ControlModel) -> float:
    """hivemind's beam search: the beam (k nodes) plus the hops that converge on it, all peers if fewer."""
    return min(peers - 1, m.bucket_size + math.log2(peers))


def lookup_rpcs_target(peers: int, m: ControlModel) -> float:
    """A Kademlia lookup of a single-writer key: α queries per hop, log2 N hops, first copy wins."""
    return min(peers - 1, m.alpha * math.log2(peers))


@dataclass(frozen=True)
class ControlBytes:
    per_peer: float  # sent + received by a peer, averaged over the swarm: 2 × total / peers
    hot_peer: float  # sent + received by the busiest peer (a replica of a hot key, or the coordinator)
    total: float  # bytes moved once over the swarm's links


def seal_reads(seal_wait_s: float, m: ControlModel, backoff_to_s: float | None = None) -> int:
    """Reads of the `seal` key by a replica that waits `seal_wait_s`: one every `seal_poll_s` and, with
    `backoff_to_s` (the code since the heartbeats stretch: the heartbeat), doubling every 2 polls up to it;
    plus the first read and the nudged one."""
    if backoff_to_s is None:
        return math.floor(seal_wait_s / m.seal_poll_s) + 2
    reads, waited = 2, 0.0
    while True:
        period = min(max(m.seal_poll_s, backoff_to_s), m.seal_poll_s * 2 ** ((reads - 2) // 2))
        if waited + period > seal_wait_s:
            return reads
        waited += period
        reads += 1


def today(
    peers: int,
    authors: int,
    sizes: RecordSizes,
    seal_wait_s: float,
    m: ControlModel,
    seal_backoff_to_s: float | None = None,
    first_copy_polls: bool = False,
) -> ControlBytes:
    """Today's scheme, per round. `authors`: peers that announce (all but the coordinator).
    `seal_backoff_to_s`, `first_copy_polls`: the seal polls of `stretched`."""
    lookup = lookup_rpcs_today(peers, m) * m.rpc_bytes
    copies = min(peers, m.dht_replicas)  # every replica in the beam answers a `latest` read
    beats = m.round_period_s / m.heartbeat_s
    store = beats * (lookup + copies * sizes.peer_today)
    read = beats * (lookup + copies * peers * sizes.peer_today)
    # reads at 0, 1, 2 … s return the previous seal until the nudged read gets the new one
    polls = seal_reads(seal_wait_s, m, seal_backoff_to_s)
    # the first read and the nudged one ask every replica; with `first_copy_polls`, a timed poll takes the
    # first copy it meets, except every 4th
    everywhere = 2 + (polls - 2) // 4 if first_copy_polls else polls
    seal_polls = everywhere * (lookup + copies * sizes.seal) + (polls - everywhere) * (lookup + sizes.seal)
    per_author = lookup + copies * sizes.announce + seal_polls - sizes.seal
    announce_polls = m.round_period_s / m.announce_poll_s * (lookup + copies * authors * sizes.announce)
    coordinator = announce_polls + lookup + copies * sizes.seal  # and it stores the seal
    total = peers * (store + read) + authors * per_author + coordinator
    # a replica of `peers` takes every store and sends its whole copy to every read
    replica = peers * beats * (sizes.peer_today + peers * sizes.peer_today)
    announce_replica = m.round_period_s / m.announce_poll_s * authors * sizes.announce
    return ControlBytes(2 * total / peers, max(replica, announce_replica, 2 * coordinator), total)


def stretched(
    peers: int, authors: int, sizes: RecordSizes, seal_wait_s: float, m: ControlModel
) -> ControlBytes:
    """The code since the heartbeats stretch (`hetnode/service/presence.py`, `PeerDirectory` in
    `hetnode/protocol/view.py`), per round, in a stable swarm: as `today`, but every peer stores its record
    and reads the others' once per `stretched_heartbeat_s`, and polls for the seal less often the longer
    it waits (`seal_reads`), from the first copy it meets; the coordinator still reads every
    `heartbeat_s`. A read still moves all N records: per-peer bytes fall by the ratio of the heartbeats
    and still grow with N. After each round every replica reads the coordinator's `head` entry (its
    digests, to check its own against), which the coordinator stores once a round."""
    slow = today(
        peers,
        authors,
        sizes,
        seal_wait_s,
        replace(m, heartbeat_s=m.stretched_heartbeat_s),
        seal_backoff_to_s=m.heartbeat_s,
        first_copy_polls=True,
    )
    lookup = lookup_rpcs_today(peers, m) * m.rpc_bytes
    copies = min(peers, m.dht_replicas)
    extra_beats = m.round_period_s / m.heartbeat_s - m.round_period_s / m.stretched_heartbeat_s
    coordinator_reads = extra_beats * (lookup + copies * peers * sizes.peer_today)
    head = authors * (lookup + copies * sizes.head) + lookup + copies * sizes.head
    total = slow.total + coordinator_reads + head
    return ControlBytes(2 * total / peers, max(slow.hot_peer, 2 * coordinator_reads), total)


def target(peers: int, authors: int, stages: int, sizes: RecordSizes, m: ControlModel) -> ControlBytes:
    """The target scheme, per round, in a stable swarm."""
    lookup = lookup_rpcs_target(peers, m) * m.rpc_bytes
    store = lookup + m.dht_replicas * sizes.peer_event
    beats = m.round_period_s / m.stable_heartbeat_s
    events = m.event_rate * (store + (stages - 1) * (m.rpc_bytes + sizes.peer_event))
    upkeep = m.round_period_s / m.refresh_s * math.log2(peers) * lookup
    announce = m.rpc_bytes + sizes.announce  # straight to the coordinator
    # the coordinator follows every change (who is live, who joined a chain)
    coordinator = peers * m.event_rate * (lookup + sizes.peer_event) + authors * announce
    total = peers * (beats * store + events + upkeep) + coordinator
    return ControlBytes(2 * total / peers, max(2 * coordinator, 2 * total / peers), total)


# a step of the change log without its records: {"from": 16 hex, "to": 16 hex, "peers": {}}
STEP_BYTES = len(msgpack.packb({"from": "0" * 16, "to": "0" * 16, "peers": {}}, use_bin_type=True))


@dataclass(frozen=True)
class ChangeLog:
    """The coordinator's `changes` entry under churn, per replica refresh (`protocol/view_changes.py`)."""

    steps: float  # steps the coordinator logs (and entries it stores) per round
    entry: float  # bytes of the entry, as a first-copy read gets it
    meets: float  # of a replica's refreshes per round: those that meet a change (and read the entry)
    behind: float  # of them: those more steps behind than the log keeps (and read every record as well)


def change_log(changes: float, refreshes: float, sizes: RecordSizes, m: ControlModel) -> ChangeLog:
    """`changes` record changes per round, as Poisson arrivals. The coordinator reads every heartbeat; a
    read that meets changes logs one step holding the changed records (each record's value and peer id,
    without its own key and signature). Under churn the log is full: its last `change_steps` steps, fewer
    where they do not fit `change_log_bytes`. A replica refreshes `refreshes` times a round and applies the
    steps logged since its last refresh, unless there are more than the log keeps (at most one step per
    coordinator read in its period), or the steps name more than `change_step_peers` and are not logged."""
    if changes <= 0:
        return ChangeLog(0.0, 0.0, 0.0, 0.0)
    per_read = changes * m.heartbeat_s / m.round_period_s
    p_step = 1.0 - math.exp(-per_read)  # a coordinator read meets at least one change
    steps = m.round_period_s / m.heartbeat_s * p_step
    records_per_step = per_read / p_step
    record = sizes.peer_today - RECORD_OVERHEAD_BYTES + len(msgpack.packb(PEER_ID, use_bin_type=True))
    step = STEP_BYTES + records_per_step * record
    kept = min(m.change_steps, math.floor(m.change_log_bytes / step))
    entry = kept * step + RECORD_OVERHEAD_BYTES
    meets = refreshes * (1.0 - math.exp(-changes / refreshes))
    if records_per_step > m.change_step_peers:
        return ChangeLog(steps, entry, meets, meets)
    reads = math.ceil(m.round_period_s / refreshes / m.heartbeat_s)  # coordinator reads per refresh period
    # more steps in the period than the log keeps: binomial over those reads
    behind = sum(
        math.comb(reads, k) * p_step**k * (1 - p_step) ** (reads - k) for k in range(kept + 1, reads + 1)
    )
    return ChangeLog(steps, entry, meets, refreshes * behind)


def vouched(
    peers: int,
    authors: int,
    sizes: RecordSizes,
    seal_wait_s: float,
    m: ControlModel,
    churn: bool = False,
) -> ControlBytes:
    """The code since the coordinator's head carries the digest of its view (`PeerDirectory` in
    `hetnode/protocol/view.py`), per round: as `stretched`, but where a replica read every record once per
    stretched heartbeat it reads the coordinator's `head` entry (first copy found) and reads every record
    only when the digests differ. In a stable swarm that never happens. With `churn` (`event_rate × peers`
    changes a round), a refresh that meets a change reads the coordinator's `changes` entry (first copy)
    and applies the steps since its own view (`change_log`); it reads every record only when more steps
    fell in its period than the log keeps. The coordinator keeps reading every record every heartbeat,
    stores its change log at every step and its head at every change and every half stable heartbeat.

    Waiting for a seal, a replica polls the head's `sealed` round (the first copy, every 4th poll every
    copy) instead of the seal, and reads the seal's first copy once it is out or the sealer nudged it."""
    base = stretched(peers, authors, sizes, seal_wait_s, m)
    lookup = lookup_rpcs_today(peers, m) * m.rpc_bytes
    copies = min(peers, m.dht_replicas)
    polls = seal_reads(seal_wait_s, m, m.heartbeat_s)
    everywhere = 2 + (polls - 2) // 4
    seal_polls_before = everywhere * (lookup + copies * sizes.seal) + (polls - everywhere) * (
        lookup + sizes.seal
    )
    head_polls = sum(lookup + (copies if p % 4 == 0 else 1) * sizes.head for p in range(polls - 1))
    seal_polls = head_polls + lookup + sizes.seal  # one seal, its first copy: that one is sync, not control
    refreshes = m.round_period_s / m.stretched_heartbeat_s  # per replica per round
    full_read = lookup + copies * peers * sizes.peer_today
    changes = m.event_rate * peers if churn else 0.0
    log = change_log(changes, refreshes, sizes, m)
    full_reads = log.behind  # a refresh further behind than the log keeps reads every record
    replicas = peers - 1
    head_stores = (m.round_period_s / (m.stretched_heartbeat_s / 2) + changes) * (
        lookup + copies * sizes.head
    )
    log_stores = log.steps * (lookup + copies * log.entry)
    total = (
        base.total
        - authors * (seal_polls_before - seal_polls)
        - replicas * refreshes * full_read
        + replicas * (refreshes * (lookup + sizes.head) + full_reads * full_read)
        + replicas * log.meets * (lookup + log.entry)
        + head_stores
        + log_stores
    )
    # a replica of the `peers` key: every store, the coordinator's reads, and the replicas' full reads
    beats = m.round_period_s / m.stretched_heartbeat_s
    coordinator_reads = m.round_period_s / m.heartbeat_s * peers * sizes.peer_today
    peers_replica = (
        peers * beats * sizes.peer_today
        + coordinator_reads
        + replicas * full_reads * peers * sizes.peer_today
    )
    # a replica of the `changes` key, if every first-copy read of it met the same one
    changes_replica = log.steps * log.entry + replicas * log.meets * log.entry
    return ControlBytes(2 * total / peers, max(peers_replica, changes_replica, 2 * coordinator_reads), total)
