"""The sync payloads a replica holds, and whom it serves them to (docs/security.md, "Send useless or harmful
work": copied work).

A replica holds its own signed payloads (the round it announced, and the one before, which a late sealer
may still fetch) and the sealed payloads it applied (for KEEP_ROUNDS rounds, so a round spreads without a
hub). Its own payload of a round not yet sealed goes only to the round's sealers: the coordinator and the
manifest's stand-ins. Anyone else asking for it before the seal could announce a copy of it as their own
work; once the round is sealed, a copy is too late to be sealed in it and a round too old for the next.
Honest readers ask only after the seal, which may reach them before it reaches us: such a request wakes
our seal wait and is answered once the seal is seen here (or refused after UNSEALED_WAIT_S).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Iterable

from hetnode.net.budgets import Refused

log = logging.getLogger(__name__)

KEEP_ROUNDS = 2  # rounds of applied payloads a replica keeps serving (peers a round behind still fetch)
UNSEALED_WAIT_S = 3.0  # how long a request for our unsealed payload waits for the seal to reach us
WAKE_EVERY_S = 1.0  # at most one early seal read per second, however many peers ask
SEAL_CHECK_S = 0.05


class HeldPayloads:
    def __init__(
        self,
        peer_id: str,
        sealers: Iterable[str],
        sealed_by_us: Callable[[int, str, str], bytes | None],
        wake_seal_wait: Callable[[], None],
        params_round: Callable[[], int],
    ) -> None:
        """`sealers`: who may fetch our payload before its round is sealed; `sealed_by_us(round, shard,
        replica)`: a payload of a round this replica sealed as the stand-in; `wake_seal_wait`: read the
        seal now rather than at the next poll; `params_round`: the round of the θ we hold (a round it
        includes is sealed, however we got there)."""
        self.peer_id = peer_id
        self.sealers = frozenset(sealers)
        self.sealed_by_us = sealed_by_us
        self.wake_seal_wait = wake_seal_wait
        self.params_round = params_round
        self.own: dict[int, dict[str, bytes]] = {}  # round -> shard -> our signed payload
        # round -> (author, shard) -> the sealed payloads we applied, served to peers that fetch them
        self.applied: dict[int, dict[tuple[str, str], bytes]] = {}
        self.seen_sealed = -1  # the newest round whose seal this replica has seen
        self._woke_at = float("-inf")
        self.refused = 0  # requests for an unsealed payload of ours by a peer that is not a sealer

    def keep_own(self, round_: int, signed: dict[str, bytes]) -> None:
        self.own = {r: p for r, p in self.own.items() if r >= round_ - 1}
        self.own[round_] = signed

    def own_payload(self, round_: int, shard: str) -> bytes | None:
        return self.own.get(round_, {}).get(shard)

    def keep_applied(self, round_: int, payloads: dict[tuple[str, str], bytes]) -> None:
        """What we applied of `round_` ((author, shard) -> bytes; our own are held already)."""
        self.applied = {r: p for r, p in self.applied.items() if r > round_ - KEEP_ROUNDS}
        self.applied[round_] = {key: data for key, data in payloads.items() if key[0] != self.peer_id}
        self.saw_seal(round_)

    def saw_seal(self, round_: int) -> None:
        self.seen_sealed = max(self.seen_sealed, round_)

    def sealed_through(self) -> int:
        return max(self.seen_sealed, self.params_round())

    def local(self, round_: int, shard: str, replica: str) -> bytes | None:
        """The payload if it is here, whoever asks (our own use: no rule applies)."""
        if replica == self.peer_id:
            return self.own_payload(round_, shard)
        applied = self.applied.get(round_, {}).get((replica, shard))
        if applied is not None:
            return applied  # sealed, checked and applied here: we are one of its holders
        return self.sealed_by_us(round_, shard, replica)

    async def serve(self, round_: int, shard: str, replica: str, asker: str) -> bytes | None:
        """The payload for `asker`, None when it is not here; `Refused` for our own payload of a round
        we have not seen sealed, unless `asker` is one of its sealers."""
        if replica == self.peer_id and asker not in self.sealers and round_ > self.sealed_through():
            if self.own_payload(round_, shard) is None:
                return None
            if not await self._seal_seen_soon(round_):
                self.refused += 1
                raise Refused(
                    "unsealed",
                    f"round {round_} is not sealed: until it is, our payload goes to its sealers only",
                )
        return self.local(round_, shard, replica)

    async def _seal_seen_soon(self, round_: int) -> bool:
        now = time.monotonic()
        if now - self._woke_at >= WAKE_EVERY_S:
            self._woke_at = now
            self.wake_seal_wait()
        deadline = now + UNSEALED_WAIT_S
        while self.sealed_through() < round_:
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            await asyncio.sleep(min(SEAL_CHECK_S, left))
        return True
