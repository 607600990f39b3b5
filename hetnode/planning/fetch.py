"""Where a replica fetches each sealed payload from (TRUST §6: the sync plane without a hub).

A sealed payload is content-addressed (its sha256 is in the seal) and signed by its author, so any peer that
holds it can serve it and the fetcher checks what it got: a holder can withhold, never forge. Candidates for
a payload are its author and the replicas that already applied its round and hold its shard, ranked per
fetcher by a rendezvous hash (every fetcher ranks them in its own order, so requests spread over holders
instead of all landing on the author); the sealer comes last, as the fallback that always has it. Pure
planning: the daemon fetches, checks and retries down each payload's list.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

PayloadKey = tuple[str, str]  # (author, shard)

MAX_PARALLEL_HOLDERS = 8  # holders a replica fetches from at once
HOLDER_TIMEOUT_S = 10.0  # a holder's batch may take this long, plus PER_PAYLOAD_S per payload in it
PER_PAYLOAD_S = 2.0  # a few MB over a slow home uplink: a holder slower than that is passed over


@dataclass(frozen=True)
class Holder:
    """A peer as the fetch plan sees it: the round whose payloads it holds and the shards it holds."""

    peer: str
    params_round: int | None
    shards: frozenset[str]


def holders_of(round_: int, peers: Iterable[Holder], keep_rounds: int) -> dict[str, list[str]]:
    """{shard: peers that hold `round_`'s payloads of it}: those that applied `round_` and not more than
    `keep_rounds` − 1 rounds after it (a replica keeps the payloads of its last `keep_rounds` rounds)."""
    out: dict[str, list[str]] = {}
    for holder in peers:
        r = holder.params_round
        if r is None or not round_ <= r < round_ + keep_rounds:
            continue
        for shard in holder.shards:
            out.setdefault(shard, []).append(holder.peer)
    return out


def _rank(fetcher: str, key: PayloadKey, candidate: str) -> bytes:
    return hashlib.sha256(f"{fetcher}|{key[0]}|{key[1]}|{candidate}".encode()).digest()


def fetch_order(
    fetcher: str,
    wanted: Sequence[PayloadKey],
    holders: Mapping[str, Sequence[str]],
    sealer: str,
    max_candidates: int = 4,
) -> dict[PayloadKey, list[str]]:
    """For each wanted payload, the peers to ask, in order: up to `max_candidates` of its author and
    its shard's holders (ranked by a hash of fetcher, payload and candidate), then the sealer. Neither the
    fetcher nor a duplicate is ever listed."""
    order: dict[PayloadKey, list[str]] = {}
    for key in wanted:
        author, shard = key
        pool = {author, *holders.get(shard, ())} - {fetcher, sealer}
        ranked = sorted(pool, key=lambda candidate: _rank(fetcher, key, candidate))[:max_candidates]
        order[key] = [*ranked, sealer] if sealer != fetcher else ranked
    return order


def next_requests(
    order: Mapping[PayloadKey, list[str]], tried: dict[PayloadKey, int], avoid: set[str]
) -> dict[str, list[PayloadKey]]:
    """{peer: the payloads to ask it for now}: each payload goes to the first candidate it has not tried
    (`tried[key]` candidates are used up; advanced here past any peer in `avoid`, which failed us this
    round). A payload with no candidate left is absent: it cannot be had."""
    batches: dict[str, list[PayloadKey]] = {}
    for key, candidates in order.items():
        index = tried.get(key, 0)
        while index < len(candidates) and candidates[index] in avoid:
            index += 1
        tried[key] = index
        if index < len(candidates):
            batches.setdefault(candidates[index], []).append(key)
    return batches
