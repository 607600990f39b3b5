"""Where a replica fetches each sealed payload from (docs/scale.md: the sync plane without a hub).

A sealed payload is content-addressed (its sha256 is in the seal) and signed by its author, so any peer that
holds it can serve it and the fetcher checks what it got: a holder can withhold, never forge. Candidates for
a payload are its author and the replicas that already applied its round and hold its shard, ranked per
fetcher by a rendezvous hash (every fetcher ranks them in its own order, so requests spread over holders
instead of all landing on the author); the sealer comes last, as the fallback that always has it. Only the
round's sealed authors count as holders: a record's claim to hold a round costs nothing to make, a sealed
contribution does (it was validated and scored), so a thousand fresh identities cannot fill the lists.
Each fetcher also walks the holders in its own rendezvous order (`launch_rank`): were every fetcher to ask
the same holders first, the first few authors' uplinks would carry the whole swarm while the rest idle.
Pure planning: the daemon fetches, checks and retries down each payload's list.
"""

from __future__ import annotations

import hashlib
from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass

PayloadKey = tuple[str, str]  # (author, shard)

MAX_PARALLEL_HOLDERS = 8  # holders a replica fetches from at once
# a holder that failed us is asked only after the sealer for this many rounds: an author that withholds
# from everyone but the sealer (credit without serving) then costs each fetcher one stall, not one a round
DEMOTED_ROUNDS = 8
# A holder is passed over when no payload of its batch arrives for this long. Progress, not a deadline
# per batch: a 20 Mbit/s stage serving its slice to many fetchers at once is slow but moving, and a fixed
# deadline turned such authors over to the sealer, which then served the whole swarm.
STALL_TIMEOUT_S = 15.0


@dataclass(frozen=True)
class Holder:
    """A peer as the fetch plan sees it: the round whose payloads it holds and the shards it holds."""

    peer: str
    params_round: int | None
    shards: frozenset[str]


def holders_of(
    round_: int, peers: Iterable[Holder], keep_rounds: int, sealed_authors: Collection[str]
) -> dict[str, list[str]]:
    """{shard: peers that hold `round_`'s payloads of it}: the round's sealed authors that applied `round_`
    and not more than `keep_rounds` − 1 rounds after it (a replica keeps its last `keep_rounds` rounds)."""
    out: dict[str, list[str]] = {}
    for holder in peers:
        r = holder.params_round
        if holder.peer not in sealed_authors or r is None or not round_ <= r < round_ + keep_rounds:
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
    demoted: Collection[str] = (),
) -> dict[PayloadKey, list[str]]:
    """For each wanted payload, the peers to ask, in order: up to `max_candidates` of its author and
    its shard's holders (ranked by a hash of fetcher, payload and candidate), then the sealer; candidates
    in `demoted` (they failed us lately) come after the sealer. Neither the fetcher nor a duplicate is
    ever listed."""
    order: dict[PayloadKey, list[str]] = {}
    for key in wanted:
        author, shard = key
        pool = {author, *holders.get(shard, ())} - {fetcher, sealer}
        ranked = sorted(pool, key=lambda candidate: _rank(fetcher, key, candidate))[:max_candidates]
        trusted = [c for c in ranked if c not in demoted]
        last = [c for c in ranked if c in demoted]
        order[key] = [*trusted, sealer, *last] if sealer != fetcher else [*trusted, *last]
    return order


def launch_rank(fetcher: str, round_: int, holder: str) -> bytes:
    """The order in which `fetcher` asks holders in `round_` (lowest first): its own, not the seal's."""
    return hashlib.sha256(f"launch|{fetcher}|{round_}|{holder}".encode()).digest()


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
