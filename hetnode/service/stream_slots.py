"""The HTTP server's budget for file answers (downloads of θ): slots, per client and in all, and the pace
a download must keep to hold one.

A slot is held for as long as its client reads, so slots are what a crowd of slow readers goes for. Two
rules keep them for users (docs/security.md, "Exhaust a daemon": per-peer and global budgets):
- at most `per_client` of the `total` slots go to one client address (an IPv6 client by its /64, what one
  subscriber is usually given), so one machine cannot hold them all however many connections it opens;
- a download must keep pace as it goes, not only on average at the end: byte n must be handed over by
  `grace_s + n / min_rate` seconds after the answer began (`due_by`). A reader below the rate loses its
  slot a few seconds after the grace, not hours later when the whole file would have been due.
"""

from __future__ import annotations

import ipaddress
import threading
from collections import Counter
from enum import Enum


class Refusal(Enum):
    BUSY = "too many downloads at once"
    CLIENT = "too many downloads from your address at once"


class StreamSlots:
    """`take(client)` a slot or be told why not; `give_back(client)` when the answer ends."""

    def __init__(self, total: int, per_client: int) -> None:
        if total < 1 or per_client < 1:
            raise ValueError(f"slots must be at least 1, got total={total}, per_client={per_client}")
        self.total, self.per_client = total, per_client
        self._lock = threading.Lock()
        self._held: Counter[str] = Counter()

    def take(self, client: str) -> Refusal | None:
        key = client_key(client)
        with self._lock:
            if self._held[key] >= self.per_client:
                return Refusal.CLIENT
            if self._held.total() >= self.total:
                return Refusal.BUSY
            self._held[key] += 1
            return None

    def give_back(self, client: str) -> None:
        key = client_key(client)
        with self._lock:
            self._held[key] -= 1
            if self._held[key] <= 0:
                del self._held[key]

    def held(self) -> int:
        with self._lock:
            return self._held.total()


def client_key(host: str) -> str:
    """Whose connection this is, for the per-client rule: an IPv4 address as it is, an IPv6 address by
    its /64 (hopping addresses inside it buys nothing), an IPv4-mapped IPv6 address as the IPv4 one."""
    try:
        address = ipaddress.ip_address(host.split("%", 1)[0])
    except ValueError:
        return host
    if isinstance(address, ipaddress.IPv6Address):
        if address.ipv4_mapped is not None:
            return str(address.ipv4_mapped)
        return str(ipaddress.IPv6Network((address, 64), strict=False))
    return str(address)


def due_by(started: float, grace_s: float, min_rate: float, sent: int) -> float:
    """When byte `sent` of a download that began at `started` must have been handed to its client."""
    return started + grace_s + sent / min_rate
