"""Weight earned by verified history (TRUST §4, docs/security.md): what one identity counts for in a seal.

Identities are free, so a vote per identity is worth nothing. Each identity earns weight only by rounds the
verifier scored non-negative: a new one has none (on probation: its work is scored, not sealed, not
credited), then weighs 1 and gains 1 per such round up to `full` (`outer.probation_rounds`); a negative
score halves what it earned (never below 1 once earned: its average, not one round, judges it). The seal
carries each contribution's weight, and the aggregate, its median clip, the verifier's medians and the
credit count weight, not headcount. k identities with h verified rounds each therefore hold at most
k·min(h, full) of the round's weight, bought with k·h rounds of verified work.

Pure bookkeeping: the verifier calls `observe` with each score and reads `weight`; no torch, no I/O.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

MAX_IDENTITIES = 100_000  # remembered at once; the oldest half is forgotten beyond (they start again)


class EarnedWeight:
    def __init__(self, full: int) -> None:
        if full < 1:
            raise ValueError(f"full weight must be >= 1, got {full}")
        self.full = full
        self.verified: dict[str, int] = {}  # peer -> weight earned (0: on probation)

    def weight(self, peer: str) -> int:
        return self.verified.get(peer, 0)

    def observe(self, peer: str, score: float) -> int:
        """Take one round's score of `peer` into its weight; returns the weight now."""
        earned = self.verified.get(peer, 0)
        # a negative score halves what was earned, but a peer once verified is not put back on probation
        # for one noisy round: a harmful one is left out by its average (`Verifier.judged_negative`)
        earned = min(earned + 1, self.full) if score >= 0 else max(earned // 2, min(earned, 1))
        self.verified[peer] = earned
        if len(self.verified) > MAX_IDENTITIES:
            for old in list(self.verified)[: len(self.verified) // 2]:
                del self.verified[old]
        return earned

    def restore(self, earned: Mapping[str, int | None]) -> None:
        """Weights kept in the ledger by an earlier life (None: a verdict from before weights existed)."""
        for peer, weight in earned.items():
            if isinstance(weight, int) and weight > 0:
                self.verified[peer] = min(weight, self.full)

    @property
    def anyone(self) -> bool:
        """Whether any identity has earned weight (no: a run's first rounds, nobody to protect yet)."""
        return any(self.verified.values())

    def counted(self, peers: Iterable[str]) -> dict[str, int]:
        """What each of these peers counts for in a round's statistics: its weight, or 1 each when none of
        them earned any (a run's first rounds, or a round left to newcomers: all equal, none protected)."""
        peers = list(peers)
        earned = {peer: self.weight(peer) for peer in peers}
        return earned if any(earned.values()) else dict.fromkeys(peers, 1)

    def in_seal(self, peers: Iterable[str]) -> dict[str, int]:
        """The weights a seal gives these sealed peers (at least 1: a newcomer is sealed only when nobody
        with a record is left in the round, `Verifier.helps`)."""
        return {peer: max(w, 1) for peer, w in self.counted(peers).items()}
