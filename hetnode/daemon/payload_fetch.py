"""Fetching a sealed round's payloads from any holder (TRUST §6), checked against the seal's digests.

`fetch_sealed` asks each payload's candidates in the order `hetnode.planning.fetch` ranks them — its author,
replicas that already applied the round, the sealer last — many holders in parallel. A holder that cannot
be reached, lacks a payload, is too slow or serves bytes that do not match the sealed sha256 is passed over
for the rest of the round, and its payloads go to their next candidate. What was fetched is exactly what
was sealed: a holder can delay us, never change a byte.
"""

from __future__ import annotations

import asyncio
import logging
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass

from hetnode.daemon.rounds import sha256_hex
from hetnode.errors import HetnodeError, WireError
from hetnode.net.node import SwarmNode
from hetnode.net.streams import PeerRequestError
from hetnode.planning.fetch import (
    HOLDER_TIMEOUT_S,
    MAX_PARALLEL_HOLDERS,
    PER_PAYLOAD_S,
    PayloadKey,
    next_requests,
)

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
) -> Fetched:
    """Every payload of `order` from the first of its candidates that serves bytes matching `digests`."""
    got: dict[PayloadKey, bytes] = {}
    tried: dict[PayloadKey, int] = {}
    avoid: set[str] = set()
    bytes_from: Counter = Counter()
    gate = asyncio.Semaphore(MAX_PARALLEL_HOLDERS)

    async def from_holder(peer: str, keys: list[PayloadKey]) -> list[bytes]:
        async with gate:
            wanted = [(shard, author) for author, shard in keys]
            timeout = HOLDER_TIMEOUT_S + PER_PAYLOAD_S * len(keys)
            return await asyncio.wait_for(node.fetch_payloads(peer, round_, wanted, max_bytes), timeout)

    while len(got) < len(order):
        pending = {key: candidates for key, candidates in order.items() if key not in got}
        batches = next_requests(pending, tried, avoid)
        lost = sorted(set(pending) - {key for keys in batches.values() for key in keys})
        if lost:
            author, shard = lost[0]
            raise PayloadsUnavailable(
                f"no holder served {len(lost)} of round {round_}'s payloads (e.g. {author[-8:]}'s {shard})"
            )
        peers = list(batches)
        results = await asyncio.gather(
            *(from_holder(peer, batches[peer]) for peer in peers), return_exceptions=True
        )
        for peer, result in zip(peers, results, strict=True):
            keys = batches[peer]
            if isinstance(result, (PeerRequestError, WireError, OSError, TimeoutError)):
                log.info(
                    "round %d: %s did not serve %d payloads (%s); asking others",
                    round_,
                    peer[-8:],
                    len(keys),
                    type(result).__name__,
                )
                avoid.add(peer)
                continue
            if isinstance(result, BaseException):
                raise result
            for key, data in zip(keys, result, strict=True):
                if sha256_hex(data) != digests[key]:
                    log.warning("round %d: %s served a payload that is not the sealed one", round_, peer[-8:])
                    avoid.add(peer)
                    continue
                got[key] = data
                bytes_from[peer] += len(data)
    return Fetched(got, bytes_from, frozenset(avoid))
