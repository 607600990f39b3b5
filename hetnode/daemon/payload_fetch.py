"""Fetching a sealed round's payloads from any holder (docs/scale.md), checked against the seal's digests.

`fetch_sealed` asks each payload's candidates in the order `hetnode.planning.fetch` ranks them — its author,
replicas that already applied the round, the sealer last — many holders in parallel, each fetcher in an
order of its own. A holder that cannot be reached, lacks a payload, stalls (no payload for STALL_TIMEOUT_S)
or serves bytes that do not match the sealed sha256 is passed over for the rest of the round, and its
payloads go to their next candidate. What was fetched is exactly what
was sealed: a holder can delay us, never change a byte.
"""

from __future__ import annotations

import asyncio
import logging
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass

from hetnode.errors import HetnodeError, WireError
from hetnode.net.node import SwarmNode
from hetnode.net.streams import PeerRequestError
from hetnode.planning.fetch import (
    MAX_PARALLEL_HOLDERS,
    STALL_TIMEOUT_S,
    PayloadKey,
    launch_rank,
    next_requests,
)
from hetnode.replica.global_model import sha256_hex

log = logging.getLogger(__name__)


class PayloadsUnavailable(HetnodeError):
    """No candidate served some sealed payload."""


@dataclass(frozen=True)
class Fetched:
    payloads: dict[PayloadKey, bytes]
    bytes_from: Counter  # peer -> bytes it served us
    passed_over: frozenset[str]  # holders that failed us this round


async def fetch_sealed(
    node: SwarmNode,
    round_: int,
    order: Mapping[PayloadKey, list[str]],
    digests: Mapping[PayloadKey, str],
    max_bytes: int,
    stall_s: float = STALL_TIMEOUT_S,
) -> Fetched:
    """Every payload of `order` from the first of its candidates that serves bytes matching `digests`.

    Up to MAX_PARALLEL_HOLDERS batches (one per holder) are in flight; a freed slot goes at once to the
    holder that ranks first in our own order (`launch_rank`), with whatever we still want from it."""
    me = node.identity.peer_id
    got: dict[PayloadKey, bytes] = {}
    tried: dict[PayloadKey, int] = {}
    avoid: set[str] = set()
    bytes_from: Counter = Counter()
    in_flight: dict[asyncio.Task, tuple[str, list[PayloadKey]]] = {}

    def launch_next() -> bool:
        asked = {key for _, keys in in_flight.values() for key in keys}
        busy = {peer for peer, _ in in_flight.values()}
        waiting = {
            key: candidates for key, candidates in order.items() if key not in got and key not in asked
        }
        batches = next_requests(waiting, tried, avoid)
        lost = sorted(set(waiting) - {key for keys in batches.values() for key in keys})
        if lost:
            author, shard = lost[0]
            raise PayloadsUnavailable(
                f"no holder served {len(lost)} of round {round_}'s payloads (e.g. {author[-8:]}'s {shard})"
            )
        free = [peer for peer in batches if peer not in busy]
        if not free:
            return False
        peer = min(free, key=lambda holder: launch_rank(me, round_, holder))
        keys = batches[peer]
        wanted = [(shard, author) for author, shard in keys]
        task = asyncio.create_task(node.fetch_payloads(peer, round_, wanted, max_bytes, stall_s=stall_s))
        in_flight[task] = (peer, keys)
        return True

    try:
        while len(got) < len(order):
            while len(in_flight) < MAX_PARALLEL_HOLDERS and launch_next():
                pass
            done, _ = await asyncio.wait(in_flight, return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                peer, keys = in_flight.pop(task)
                _take(task, peer, keys, round_, digests, got, bytes_from, avoid)
    finally:
        for task in in_flight:
            task.cancel()
        await asyncio.gather(*in_flight, return_exceptions=True)
    return Fetched(got, bytes_from, frozenset(avoid))


def _take(
    task: asyncio.Task,
    peer: str,
    keys: list[PayloadKey],
    round_: int,
    digests: Mapping[PayloadKey, str],
    got: dict[PayloadKey, bytes],
    bytes_from: Counter,
    avoid: set[str],
) -> None:
    """Keep what `peer` served that matches the seal; pass `peer` over if it failed or lied."""
    error = task.exception()
    if isinstance(error, (PeerRequestError, WireError, OSError, TimeoutError)):
        log.info(
            "round %d: %s did not serve %d payloads (%s); asking others",
            round_,
            peer[-8:],
            len(keys),
            type(error).__name__,
        )
        avoid.add(peer)
        return
    if error is not None:
        raise error
    for key, data in zip(keys, task.result(), strict=True):
        if sha256_hex(data) != digests[key]:
            log.warning("round %d: %s served a payload that is not the sealed one", round_, peer[-8:])
            avoid.add(peer)
            continue
        got[key] = data
        bytes_from[peer] += len(data)
