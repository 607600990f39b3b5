"""Which worker of the next stage's pool a micro-batch goes to, and what a stage learns of each worker: pure
decisions over what the sender observed (docs/chains.md, "Pools and routing").

A sender knows, for each worker it is connected to, how many of its micro-batches the worker holds now
and how long one took it lately (round trip over the queue it joined, `ServiceTime`). A micro-batch goes
where it is expected back soonest; a worker not yet tried this round goes first, so that every worker of
the pool takes part in every round (a worker that served nothing has nothing to announce, and the seal
would wait for it).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

SERVICE_EMA = 0.3  # weight of the newest observation in a worker's time per micro-batch
NORM_EMA = 0.1  # weight of the newest frame in a link's typical log-norm
NORM_FACTOR = 32.0  # a frame this many times off the other workers' typical norm is a lie
NORM_WARMUP = 8  # frames the other workers must have sent before a norm is judged
# Two workers' gradients for one micro-batch point this close or closer (cosine) unless one lies. Two honest
# workers of a pool on tiny, from the same θ: 0.80–1.00 from 80 micro-batches each into a round (in process),
# but down to 0.02 in a round from a fresh init (daemons, every micro-batch asked twice); a gradient sent with
# its sign flipped points against the honest one's: −1.00 measured (docs/chains.md, "Second opinions")
AGREE_COS = -0.5
# Nor is one this many times the other's norm unless one lies. Two honest workers' answers in rounds from a
# fresh init on tiny (287 pairs over 11 runs of tests/daemon/test_pool_second_opinions.py): up to 47× apart
# (the tail: 11–47×), as their copies of the slice part within the round; the `grad-scaled` fault sends
# 1000× an honest gradient. Between the two in log scale, with room for both (docs/chains.md)
AGREE_NORM_FACTOR = 200.0


@dataclass(frozen=True)
class WorkerLoad:
    """One worker of the next stage as the sender sees it."""

    peer: str
    served: int  # micro-batches sent to it this round
    in_flight: int  # of those, not answered yet
    per_mb_s: float | None  # its time per micro-batch lately (None: not measured yet)


def pick_worker(workers: Sequence[WorkerLoad]) -> str:
    """The worker the next micro-batch goes to: one not tried this round (fewest in flight), else the one
    expected to answer first, (in flight + 1) × its time per micro-batch (a worker not measured yet counts
    as the fastest measured one); ties to fewer in flight, then peer id."""
    if not workers:
        raise ValueError("no worker to route to")
    untried = [w for w in workers if w.served == 0]
    if untried:
        return min(untried, key=lambda w: (w.in_flight, w.peer)).peer
    known = [w.per_mb_s for w in workers if w.per_mb_s is not None]
    fallback = min(known) if known else 1.0
    return min(
        workers,
        key=lambda w: (
            (w.in_flight + 1) * (fallback if w.per_mb_s is None else w.per_mb_s),
            w.in_flight,
            w.peer,
        ),
    ).peer


class ServiceTime:
    """A worker's time per micro-batch: each round trip divided by the queue the micro-batch joined (itself
    included), smoothed."""

    def __init__(self) -> None:
        self.per_mb_s: float | None = None

    def observe(self, round_trip_s: float, queue: int) -> None:
        sample = max(round_trip_s, 0.0) / max(queue, 1)
        self.per_mb_s = (
            sample if self.per_mb_s is None else (1 - SERVICE_EMA) * self.per_mb_s + SERVICE_EMA * sample
        )


class NormWatch:
    """The cheap statistical check of a pool: each link's typical log-norm of the tensors it sends (of one
    kind). A frame is a lie when its norm is `NORM_FACTOR` times off both its own link's typical norm and
    the other links': a worker that turns to lying changes at once, an honest one never does, and the
    other workers say which of the two moved. Judged once the link and another have `NORM_WARMUP` frames;
    frames judged off are not learned from, so a liar is compared with its honest history."""

    def __init__(self) -> None:
        self.typical: dict[str, float] = {}  # link -> EMA of log-norm
        self.count: dict[str, int] = {}

    def judge(self, link: str, norm: float) -> str | None:
        """Why a frame of norm `norm` from `link` is a lie (None: it is not, and it is learned from)."""
        value = math.log(max(norm, 1e-30))
        others = [self.typical[p] for p in self.typical if p != link and self.count[p] >= NORM_WARMUP]
        own = self.typical.get(link)
        if others and own is not None and self.count[link] >= NORM_WARMUP:
            reference = sum(others) / len(others)
            limit = math.log(NORM_FACTOR)
            if abs(value - reference) > limit and abs(value - own) > limit:
                return (
                    f"a tensor of norm {norm:.3g}, {math.exp(abs(value - own)):.0f}× off its own and "
                    f"{math.exp(abs(value - reference)):.0f}× off the {math.exp(reference):.3g} the "
                    "stage's other workers send"
                )
        self.learn(link, norm)
        return None

    def learn(self, link: str, norm: float) -> None:
        """Take a frame's norm into its link's typical one (a frame judged off, then found honest)."""
        value, own = math.log(max(norm, 1e-30)), self.typical.get(link)
        self.typical[link] = value if own is None else (1 - NORM_EMA) * own + NORM_EMA * value
        self.count[link] = self.count.get(link, 0) + 1

    def forget(self, link: str) -> None:
        self.typical.pop(link, None)
        self.count.pop(link, None)


def gradients_agree(cosine: float, norm_ratio: float) -> bool:
    """Whether two workers' gradients for one micro-batch agree: they point the same way (`AGREE_COS`) and
    neither is `AGREE_NORM_FACTOR` times the other."""
    return cosine >= AGREE_COS and norm_ratio <= AGREE_NORM_FACTOR


def odd_one_out(agree: dict[frozenset[str], bool]) -> str | None:
    """The worker that lies, from whether each pair of three workers' gradients for one micro-batch agree
    (`gradients_agree`): the one that disagrees with both others while those two agree; None when no one
    worker stands alone (all agree, or the others disagree with each other too: no majority)."""
    peers = sorted({p for pair in agree for p in pair})
    if len(peers) != 3 or len(agree) != 3:
        raise ValueError(f"three workers' pairwise verdicts are needed, got {len(agree)} pairs")
    for odd in peers:
        others = [p for p in peers if p != odd]
        if agree[frozenset(others)] and not any(agree[frozenset((odd, o))] for o in others):
            return odd
    return None
