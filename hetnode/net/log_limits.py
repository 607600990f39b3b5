"""Rate-limited warnings for refusals: a peer hammering us must not flood the log (docs/security.md, "Exhaust
a daemon").

At most one line per (peer, reason) per period and `max_lines` lines per period in all (identities are
free, so a per-peer limit alone would let many identities flood it); what was held back is summed up in
one "N refusals suppressed" line at the start of the next period that sees a refusal.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Callable


class RefusalLog:
    """Warnings about refused requests, at most ~one per (peer, reason) per `period_s`."""

    def __init__(
        self,
        logger: logging.Logger,
        period_s: float = 60.0,
        max_lines: int = 30,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.logger = logger
        self.period_s = period_s
        self.max_lines = max_lines
        self.clock = clock
        self._window_start = clock()
        self._seen: set[tuple[str, str]] = set()  # emptied each period: it stays small
        self._lines = 0
        self._suppressed: Counter[str] = Counter()

    def warning(self, peer: str, reason: str, message: str, *args: object) -> bool:
        """Log `message % args` unless (peer, reason) was logged this period; True when it was logged."""
        self._roll()
        key = (peer, reason)
        if key in self._seen or self._lines >= self.max_lines:
            self._suppressed[reason] += 1
            return False
        self._seen.add(key)
        self._lines += 1
        self.logger.warning(message, *args)
        return True

    def suppressed(self) -> int:
        """Refusals held back in the current period (not yet summed up in a line)."""
        return sum(self._suppressed.values())

    def _roll(self) -> None:
        now = self.clock()
        if now - self._window_start < self.period_s:
            return
        if self._suppressed:
            by_reason = ", ".join(f"{reason} {n}" for reason, n in self._suppressed.most_common())
            self.logger.warning(
                "%d refusals suppressed in the last %.0f s (%s)",
                sum(self._suppressed.values()),
                now - self._window_start,
                by_reason,
            )
        self._window_start = now
        self._seen.clear()
        self._lines = 0
        self._suppressed.clear()
