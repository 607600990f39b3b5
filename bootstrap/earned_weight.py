"""Weight earned by verified history (docs/security.md, "Send useless or harmful work", docs/security.md):
what one identity counts for in a seal.

Identities are free, so a vote per identity is worth nothing. Each identity earns weight only by rounds the
verifier scored non-negative: a new one has none (on probation: its work is scored, not sealed, not
credited), then weighs 1 and gains 1 per such round up to `full` (`outer.probation_rounds`); a negative
score halves what it earned (never below 1 once earned: its average, not one round, judges it). A score
below `STRIKE_SCORE`, far below a free rider's, is a strike: each halves the identity's ceiling for good
(full, full/2, …, 0), so one that sends harmful work only when it expects not to be scored can afford few
strikes being caught (no honest replica scored below +0.12 in the rounds.jsonl scores of 14 swarm-test
runs; sign flips −0.16 to −0.79). The seal
carries each contribution's weight, and the aggregate, its median clip, the verifier's medians and the
credit count weight, not headcount. k identities with h verified rounds each therefore hold at most
k·min(h, full) of the round's weight, bought with k·h rounds of verified work.

Pure bookkeeping: the verifier calls `observe` with each score and reads `weight`; no torch, no I/O.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

MAX_IDENTITIES = 100_000  # remembered at once; the oldest half is forgotten beyond (they start again)
STRIKE_SCORE = -0.2  # twice a free rider's score (−SCORE_MARGIN): the update made the loss worse


class EarnedWeight:
    def __init__(self, full: int) -> None:
        if full < 1:
            raise ValueError(f"full weight must be >= 1, got {full}")
        self.full = full
        self.verified: dict[str, int] = {}  # peer -> weight earned (0: on probation)
        self.strikes: dict[str, int] = {}  # peer -> scores below STRIKE_SCORE

    def weight(self, peer: str) -> int:
        return self.verified.get(peer, 0)

    def ceiling(self, peer: str) -> int:
        """The most `peer` can weigh: full, halved for each strike."""
        return self.full >> min(self.strikes.get(peer, 0), 62)

    def observe(self, peer: str, score: float) -> int:
        """Take one round's score of `peer` into its weight; returns the weight now."""
        earned = self.verified.get(peer, 0)
        if score < STRIKE_SCORE:
            self.strikes[peer] = self.strikes.get(peer, 0) + 1
        # a negative score halves what was earned, but a peer once verified is not put back on probation
        # for one noisy round: a harmful one is left out by its average (`Verifier.judged_negative`)
        earned = earned + 1 if score >= 0 else max(earned // 2, min(earned, 1))
        earned = min(earned, self.ceiling(peer))
        self.verified[peer] = earned
        for book in (self.verified, self.strikes):
            if len(book) > MAX_IDENTITIES:
                for old in list(book)[: len(book) // 2]:
                    del book[old]
        return earned

    def restore(self, earned: Mapping[str, int | None], strikes: Mapping[str, int] | None = None) -> None:
        """Weights and strikes kept in the ledger by an earlier life (a weight None: a verdict from before
        weights existed)."""
        self.strikes.update({peer: n for peer, n in (strikes or {}).items() if n > 0})
        for peer, weight in earned.items():
            if isinstance(weight, int) and weight > 0:
                self.verified[peer] = min(weight, self.ceiling(peer))

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
