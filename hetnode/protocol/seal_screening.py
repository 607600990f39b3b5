"""The coordinator's verifier at the seal (docs/security.md, "Send useless or harmful work"): the hooks it
hands the sealer (`Screen`, `Rescue`, `Weigh`), and the sealer's use of them. A verifier bug never stops
sealing: a failed screen seals unscreened, a failed rescue seals nothing the screen refused, a failed weighing
seals with weight 1, and
each says so in the log. A stand-in seals without them."""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable

from hetnode.protocol.payload_checks import Checked
from hetnode.wire.sync_payload import DecodedPayload

log = logging.getLogger(__name__)

# (round, contributions, when each was seen, the inner steps each claims) -> {peer: why it is left out}
Screen = Callable[
    [int, list[tuple[str, list[DecodedPayload]]], dict[str, float], dict[str, int]], dict[str, str]
]
# (round, contributions left out only for their author's record) -> the peers whose work helps on its own
Rescue = Callable[[int, list[tuple[str, list[DecodedPayload]]], dict[str, int]], Awaitable[set[str]]]
# the sealed peers -> the weight each carries in the aggregate (earned by verified history, docs/security.md,
# "Send useless or harmful work")
Weigh = Callable[[list[str]], dict[str, int]]
RESCUABLE = ("score", "probation")  # screen reasons about an author's record, not about the work itself


def screened(screen: Screen | None, round_: int, good: list[Checked]) -> dict[str, str]:
    """The screen's verdicts on the valid contributions (they are left out, not banned: the verifier
    keeps scoring them, and a peer whose work helps again comes back)."""
    if screen is None or not good:
        return {}
    by_arrival = sorted(good, key=lambda g: (g[0].seen_at, g[0].peer_id))
    try:
        rejected = screen(
            round_,
            [(a.peer_id, decoded) for a, _, decoded in by_arrival],
            {a.peer_id: a.seen_at for a, _, _ in by_arrival},
            {a.peer_id: a.steps for a, _, _ in by_arrival},
        )
    except Exception:  # a verifier bug must not stop sealing: seal unscreened and say so
        log.exception("round %d: screening failed; sealing without it", round_)
        return {}
    for peer, reason in sorted(rejected.items()):
        log.warning("round %d: leaving out %s's contribution: %s", round_, peer, reason)
    return rejected


async def rescued(
    rescue: Rescue | None, round_: int, good: list[Checked], rejected: dict[str, str]
) -> dict[str, str]:
    """The screen left nothing: contributions left out only for their author's record (a negative
    average, or none yet) are sealed after all if their update alone lowers the loss, so that a replica
    left alone (a chain whose anchor died, newcomers after everyone else left) keeps the swarm going.
    Their credit still waits for their record (docs/security.md, "Send useless or harmful work")."""
    candidates = [(a.peer_id, decoded) for a, _, decoded in good if rejected[a.peer_id] in RESCUABLE]
    if rescue is None or not candidates:
        return rejected
    try:
        helping = await rescue(round_, candidates, {a.peer_id: a.steps for a, _, _ in good})
    except Exception:  # a verifier bug must not seal what the screen refused
        log.exception("round %d: judging the screened-out contributions failed", round_)
        return rejected
    if helping:
        log.info(
            "round %d: every contribution was screened out; sealing %s: their update lowers the loss",
            round_,
            ", ".join(sorted(helping)),
        )
    return {peer: reason for peer, reason in rejected.items() if peer not in helping}


def earned_weights(weigh: Weigh | None, recent: dict[str, int], peers: list[str]) -> dict[str, int]:
    """Each sealed peer's weight in the aggregate: the verifier's; without one (a stand-in), those of the
    last seal applied (`recent`; an identity absent from it weighs 1: a newcomer while the coordinator is
    away); 1 each when a bug leaves none to give."""
    if weigh is None:
        return {peer: recent.get(peer, 1) for peer in peers}
    try:
        weights = weigh(peers)
        if set(weights) != set(peers):
            raise ValueError(f"weights for {sorted(weights)}, not {sorted(peers)}")
        return weights
    except Exception:  # a verifier bug must not stop sealing: seal with equal weights and say so
        log.exception("weighing the round's contributions failed; sealing them with weight 1")
        return dict.fromkeys(peers, 1)
