"""θ for peers catching up, encoded once per (round, shard) however many peers ask.

Encoding a shard of dense θ is slow (it copies every parameter), so the provider runs in a worker thread,
at most once at a time per (round, shard); concurrent askers share that run. Answers are kept for the
newest round only, and only for `keep_s` after the last one was encoded: dense θ of a large model is
gigabytes, not something to hold while nobody is catching up.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

StateProvider = Callable[[int, str], bytes | None]  # (round, shard) -> a dense payload or None
KEEP_S = 300.0  # catch-ups come in bursts after a restart or a failed round: minutes, not hours


class StateCache:
    """The last round's encoded shards, in front of a `StateProvider`."""

    def __init__(self, provider: StateProvider, keep_s: float = KEEP_S) -> None:
        self.provider = provider
        self.keep_s = keep_s
        self.encodings = 0  # provider calls (for tests and metrics)
        self._round: int | None = None
        self._entries: dict[str, bytes] = {}
        self._pending: dict[tuple[int, str], asyncio.Future[bytes | None]] = {}
        self._expiry: asyncio.TimerHandle | None = None

    async def get(self, round_: int, shard: str) -> bytes | None:
        """The provider's answer for (round_, shard), from the cache when it holds it."""
        if round_ == self._round and shard in self._entries:
            return self._entries[shard]
        key = (round_, shard)
        pending = self._pending.get(key)
        if pending is None:
            self.encodings += 1
            pending = asyncio.ensure_future(asyncio.to_thread(self.provider, round_, shard))
            self._pending[key] = pending
            pending.add_done_callback(lambda done: self._settle(key, done))
        # one asker giving up (a timeout, a closed stream) must not cancel the others' encoding
        return await asyncio.shield(pending)

    def clear(self) -> None:
        """Forget everything (a new provider, a shutdown)."""
        self._round = None
        self._entries.clear()
        if self._expiry is not None:
            self._expiry.cancel()
            self._expiry = None

    def _settle(self, key: tuple[int, str], done: asyncio.Future[bytes | None]) -> None:
        if self._pending.get(key) is done:
            del self._pending[key]
        if done.cancelled() or done.exception() is not None:
            return  # every asker sees the error; nothing is kept
        data = done.result()
        round_, shard = key
        if not isinstance(data, bytes) or (self._round is not None and round_ < self._round):
            return  # None (not held now) may change later; an older round must not evict the newest
        if round_ != self._round:
            self._entries.clear()
            self._round = round_
        self._entries[shard] = data
        if self._expiry is not None:
            self._expiry.cancel()
        self._expiry = asyncio.get_running_loop().call_later(self.keep_s, self.clear)
