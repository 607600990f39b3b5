"""When to seal a sync round, and who is in it: pure decisions over the announcements seen so far.

A round is sealed when every expected replica has announced, or when an adaptive deadline has passed since the
round's clock started. The deadline is learned from how late the last expected replica arrived in recent
rounds (docs/sync.md, "Rounds over the network": "deadline from observed arrival times, not a fixed
constant"), clamped to a floor and a ceiling so that one slow round neither stalls the swarm nor cuts the next
one short. The clock starts at the first announcement of an expected replica the sealer has sealed before,
never at a stranger's: an identity that announces the moment a round opens must not fire the deadline before
the honest replicas announce (docs/security.md, "Exhaust a daemon").

Once sealing starts, the payloads still on their way get `FetchDeadline` more: an author that misses it is
left out, so no author holds a seal hostage by serving slowly.
"""

from __future__ import annotations

import hashlib
import math
from collections import deque
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from hetnode.algo.quantiles import weighted_quantile
from hetnode.config import Config
from hetnode.planning.roles import ChainStatus

NUM_DATA_SLOTS = 256  # replicas pick a slot from their peer id; slots are disjoint slices of the data
BATCH_OFFSETS = 2**20  # replicas that share a data slot start this far apart in its stream of batches


def assigned_batches(replica: str, round_: int, inner_steps: int, stride: int | None = None) -> range:
    """The batch indices (within its data slot) `replica` (a peer id, or a chain id) trains in `round_`:
    public, so a verifier can score a contribution on the very batches it was trained on (docs/security.md,
    "Send useless or harmful work").

    Round t's batches start at t · `stride` (the most steps a round may have; default `inner_steps`) and
    the replica takes the first `inner_steps` of them: however many steps each round had, the rounds'
    batches never overlap, and the steps a replica claims name exactly the batches it trained.

    Slots are few (256) and peers many: two replicas often share a slot, and would train the very same
    batches (identical work, which verification rightly takes for a copy). Each replica therefore starts
    at its own offset in the slot's stream; every epoch of the stream is a fresh permutation, so offsets
    far apart mean other windows."""
    if stride is not None and not 0 <= inner_steps <= stride:
        raise ValueError(f"{inner_steps} steps do not fit a round of at most {stride}")
    digest = hashlib.sha256(b"hetnode-batches:" + replica.encode()).digest()
    start = int.from_bytes(digest[:4], "big") % BATCH_OFFSETS + round_ * (stride or inner_steps)
    return range(start, start + inner_steps)


def data_slot(peer_id: str) -> int:
    """The data slot `peer_id` (a peer id, or a chain id) trains on, out of NUM_DATA_SLOTS."""
    return int.from_bytes(hashlib.sha256(peer_id.encode()).digest()[:4], "big") % NUM_DATA_SLOTS


SIT_OUT_SLACK = 1.25  # paced: a replica whose floor of steps would overrun the budget by more sits out
# paced: the share of its round a replica's inner steps should fill. A round's close (compress, encode) is
# a fixed cost; a slow machine at one step a round spends a good part of it closing (a quarter core: 1 s of
# a 4.5 s round, utilisation 0.75), so it asks for a floor of steps that fills this share
BUSY_SHARE = 0.9


@dataclass
class RoundBudget:
    """Paced rounds: the wall-clock seconds a round's training gets, learned from the swarm.

    Each sealed replica (a chain once) says how long it spent in inner steps and how many it took; from
    that, the time it would take for H steps. Counted by seal weight (identities without a verified
    history weigh nothing, so strangers cannot move it) over the last `keep` rounds, the budget is the
    `quantile` of those times counted from the fastest: at the median (0.5) the typical replica trains about
    H steps, a faster one more and a slower one fewer; at 0.25 the fastest quarter trains H. But at most
    what the fastest quarter (by weight) needs for the cap (`cap_ratio` × H), so that where most replicas
    are slow the fast ones are not held at the cap waiting for them. Within [floor_s, ceiling_s]. None
    until a round with timings was sealed."""

    inner_steps: int
    floor_s: float
    ceiling_s: float
    cap_ratio: float = 2.0  # max_inner_steps / H
    quantile: float = 0.5  # outer.budget_quantile
    keep: int = 4
    rounds: deque[list[tuple[float, int]]] = field(default_factory=deque)

    def observe(self, timings: Iterable[tuple[float, int, int]]) -> None:
        """One sealed round's (seconds in inner steps, steps, weight) per replica that has them."""
        samples = [
            (seconds * self.inner_steps / steps, weight)
            for seconds, steps, weight in timings
            if steps > 0 and weight > 0 and math.isfinite(seconds) and seconds > 0
        ]
        if samples:
            self.rounds.append(samples)
            while len(self.rounds) > self.keep:
                self.rounds.popleft()

    @property
    def seconds(self) -> float | None:
        return self.seconds_for(())

    def seconds_for(self, floors: Iterable[float]) -> float | None:
        """The budget, raised to let in the live replicas whose floor of steps takes `floors` seconds (each
        says so in its record: it sits out while its floor does not fit), but never past what the fastest
        quarter needs for the cap: a claim of slowness, which nobody can check, makes the fast train up to
        their cap and rounds that much longer, never idle."""
        samples = sorted(sample for round_ in self.rounds for sample in round_)
        if not samples:
            return None
        most = self.cap_ratio * weighted_quantile(samples, 0.25)
        waiting = max((f for f in floors if math.isfinite(f) and f > 0), default=0.0)
        budget = min(max(weighted_quantile(samples, self.quantile), waiting), most)
        return min(self.ceiling_s, max(self.floor_s, budget))


def floor_seconds(
    floor: int, pace_s: float | None, ceiling_s: float, overhead_s: float = 0.0
) -> float | None:
    """Paced: the seconds a replica's floor of steps takes at its measured pace (per step, plus a fixed
    `overhead_s` a round), within (0, `ceiling_s`]: what it says in its record (None: not measured yet)."""
    if pace_s is None:
        return None
    return min(ceiling_s, max(1e-3, floor * pace_s + overhead_s))


def busy_floor(floor: int, cap: int, step_s: float | None, close_s: float | None) -> int:
    """Paced: the fewest inner steps at which a replica whose steps take `step_s` and whose round's close
    takes `close_s` fills BUSY_SHARE of its round with steps: at least `floor`, at most `cap` (the floor a
    replica asks the budget to fit in its record; the config's floor is still what it must reach)."""
    if not step_s or not close_s or step_s <= 0 or close_s <= 0:
        return floor
    wanted = math.ceil(BUSY_SHARE * close_s / ((1 - BUSY_SHARE) * step_s) - 1e-9)
    return min(cap, max(floor, wanted))


def sits_out(budget_s: float | None, step_s: float | None, floor: int) -> bool:
    """Paced: whether a replica whose inner steps take `step_s` sits this round out, because even its
    floor of steps would overrun the budget by more than SIT_OUT_SLACK (instead of stretching the round)."""
    if budget_s is None or step_s is None:
        return False
    return floor * step_s > SIT_OUT_SLACK * budget_s


def another_step(
    steps: int,
    elapsed_s: float,
    step_s: float | None,
    budget_s: float | None,
    floor: int,
    cap: int,
    nominal: int,
) -> bool:
    """Paced: whether a replica that has taken `steps` in `elapsed_s` of its round takes one more: always
    below the floor, never at the cap, else while the next one (of about `step_s`) ends within the budget.
    No budget yet (a new run) or no timing yet: the nominal H."""
    if steps >= cap:
        return False
    if steps < floor:
        return True
    if budget_s is None or step_s is None:
        return steps < nominal
    return elapsed_s + step_s <= budget_s


def round_budget_left(
    budget_s: float | None, began: float, round_: int, seal_seen: tuple[int, float] | None
) -> float | None:
    """Paced: the budget of round `round_`, begun at `began` (monotonic), counted from that start: its own
    budget, but ending no later than a budget after the seal of the round before was seen (`seal_seen`:
    that round and when, same clock). A replica that starts late (a chain formed again mid-round, a stage
    that caught up) then ends with the swarm's round and is sealed in it, instead of ending a budget after
    the others and missing it, and the round after it too (measured: a chain re-formed around a spare lost
    5 rounds of 6 s). No effect on a replica that started on time."""
    if budget_s is None or seal_seen is None or seal_seen[0] != round_ - 1:
        return budget_s
    return max(0.0, min(budget_s, seal_seen[1] + budget_s - began))


@dataclass(frozen=True)
class Announcement:
    """A replica's claim that its payload for `round` is ready: one sha256 per shard it contributes."""

    peer_id: str
    round: int
    shards: Mapping[str, str]
    tokens: int
    seen_at: float  # when the sealer first saw it (its own clock)
    steps: int = 0  # inner steps behind it (the ledger credits them)
    train_s: float = 0.0  # seconds its replica spent in them (paced rounds learn the budget from it)


@dataclass
class ArrivalDeadline:
    """Seconds to wait after the first announcement of a round, learned from recent rounds."""

    floor_s: float
    ceiling_s: float
    factor: float = 2.0
    round_share: float = 0.5  # never wait less than this share of a typical round
    history: deque[float] = field(default_factory=lambda: deque(maxlen=8))
    rounds: deque[float] = field(default_factory=lambda: deque(maxlen=8))

    def observe(self, spread_s: float) -> None:
        """Record how long after the first announcement the last expected one arrived."""
        if spread_s >= 0:
            self.history.append(spread_s)

    def observe_round(self, duration_s: float) -> None:
        """Record the time from one round's first announcement to the next one's.

        A replica that rejoins, or shares its machine, can lag by a good part of a round while the others'
        spread is near zero; a floor in proportion to the round keeps it in rather than always one behind.
        """
        if duration_s > 0:
            self.rounds.append(duration_s)

    @property
    def seconds(self) -> float:
        if not self.history:
            return self.ceiling_s
        floor = self.floor_s
        if self.rounds:
            floor = max(floor, self.round_share * sorted(self.rounds)[len(self.rounds) // 2])
        return min(self.ceiling_s, max(floor, self.factor * max(self.history)))


PACED_WAIT_BUDGETS = 1.5  # paced: the most a seal waits past a round's first announcement, in budgets


def paced_deadline(learned_s: float, floor_s: float, budget_s: float | None) -> float:
    """The seal's wait under paced rounds: the learned deadline, but at most `PACED_WAIT_BUDGETS` of the
    round's budget (never below `floor_s`). Every replica was given the budget to train in, so whoever
    announces a budget after the first did not fit it. Without the bound a late replica teaches the deadline
    to wait longer, the seal's wait delays every replica's next round (at most one unapplied round), and the
    rounds grow: measured with a chain whose stages waited for each other's seal, 3 s rounds became 41 s
    (benchmarks/results/utilization-caps)."""
    if budget_s is None:
        return learned_s
    return min(learned_s, max(floor_s, PACED_WAIT_BUDGETS * budget_s))


def seal_now(
    expected: Iterable[str],
    announced: Mapping[str, Announcement],
    now: float,
    deadline_s: float,
    ceiling_s: float | None = None,
    trusted: Iterable[str] = (),
) -> bool:
    """True when every expected replica announced, or the deadline passed since the round's clock started.

    The clock starts at the first announcement of an expected replica in `trusted` (sealed in recent
    rounds), or, when no expected replica is trusted (a new run), of any expected replica. Others'
    announcements (strangers, newcomers) never start it: when only they announced, the round waits
    `ceiling_s` from the first of them."""
    if not announced:
        return False
    expected = set(expected)
    if expected <= set(announced):
        return True
    starters = (set(trusted) & expected) or expected
    times = [a.seen_at for peer, a in announced.items() if peer in starters]
    if times:
        return now - min(times) >= deadline_s
    first = min(a.seen_at for a in announced.values())
    return now - first >= (deadline_s if ceiling_s is None else ceiling_s)


def lost_records(
    expected_before: Iterable[str], in_view: Iterable[str], departed: Iterable[str], missed: Iterable[str]
) -> set[str]:
    """The replicas a seal waited for last time whose record the view has lost without a word of leaving
    (no offline record): still waited for, until they miss a round. Records live seconds and a DHT can hide or
    drop them (docs/security.md, "Exhaust a daemon"), while announcements come to the sealer directly; a
    replica that is gone
    costs one deadline."""
    gone = set(in_view) | set(departed) | set(missed)
    return {peer for peer in expected_before if peer not in gone}


# lineage -> (the live chain's name, the members its layout names)
ChainsAtOpen = dict[str, tuple[str, frozenset[str]]]


def chains_at_open(chains: Iterable[ChainStatus]) -> ChainsAtOpen:
    """The live chains as a round opens (the view at the seal before it), by lineage."""
    return {c.lineage or c.chain: (c.chain, frozenset(c.members)) for c in chains if c.live}


def restarted_chains(at_open: ChainsAtOpen, chains_now: Iterable[ChainStatus]) -> set[str]:
    """The peers of the chains that dropped the round in flight: a chain live when the round opened that is
    neither live now nor grown into a live chain of its lineage holding all its members (a member left or
    broke: its in-flight work is gone). Their members, and those of their lineage's successor (a spare
    stepping in restarts the round from nothing), are not waited for in this round: the round in flight
    is the one a break may cost (docs/chains.md, "Spares"), and a seal that waited for it would delay
    every replica's next round and the successor's first."""
    chains_now = list(chains_now)
    live = [c for c in chains_now if c.live]
    peers: set[str] = set()
    for lineage, (chain, members) in at_open.items():
        if any(c.chain == chain for c in live):
            continue
        if any((c.lineage or c.chain) == lineage and members <= c.members for c in live):
            continue  # it grew: the same members, more workers, the round goes on
        peers |= members
        for c in chains_now:
            if (c.lineage or c.chain) == lineage:
                peers |= c.members
    return peers


@dataclass
class FetchDeadline:
    """How long sealing waits for the payloads still on their way once it starts.

    At least the time a payload of `max_bytes` takes at the slowest uplink the run admits (`min_mbps`),
    so no admitted peer is cut short, and `factor` × the median time honest payloads took from
    announcement to checked in recent rounds (a median: a few slow identities cannot stretch it), at
    most `ceiling_s`."""

    floor_s: float
    ceiling_s: float
    factor: float = 4.0
    took: deque[float] = field(default_factory=lambda: deque(maxlen=32))

    @staticmethod
    def floor_for(max_bytes: int, min_mbps: float, base_s: float) -> float:
        return base_s + 2 * max_bytes * 8 / (max(min_mbps, 0.1) * 1e6)

    def observe(self, seconds: float) -> None:
        if seconds >= 0:
            self.took.append(seconds)

    @property
    def seconds(self) -> float:
        if not self.took:
            return min(self.ceiling_s, self.floor_s)
        median = sorted(self.took)[len(self.took) // 2]
        return min(self.ceiling_s, max(self.floor_s, self.factor * median))


def held_back_s(times_late: int, first_s: float, most_s: float) -> float:
    """How long an author that missed the fetch deadline `times_late` rounds running is not waited for
    (nor fetched): doubling, so a slow-serving identity costs the swarm one deadline per doubling."""
    return min(most_s, first_s * 2 ** max(0, times_late - 1))


def sealed_order(contributions: Iterable[Announcement]) -> list[Announcement]:
    """The fixed order every replica aggregates in (by peer id), so results are bit-identical."""
    return sorted(contributions, key=lambda a: a.peer_id)


def replica_tokens(config: Config) -> int:
    """Tokens one replica trains per round by the manifest's schedule (H × batch × sequence): what a
    sealed contribution earns, split over a chain's stages by the parameters each delivered (docs/security.md,
    "Who is trusted with what";
    docs/observability.md, "Contribution credit")."""
    return config.outer.inner_steps * config.data.batch_size * config.data.seq_len


def shard_order(n_layers: int) -> list[str]:
    """The model's shards in input-to-output order: "embed", "0".."L-1", "head"."""
    return ["embed", *(str(i) for i in range(n_layers)), "head"]
