"""WAN links for the network lab: a host's link profile (rates, one-way delay, jitter, loss) and the
delay line that decides when each packet leaves, or that it is lost.

The kernel here has tbf and htb but no netem, so rates stay in tc while delay, jitter and loss happen in
a user-space emulator (hetnode/lab/netlab/wan_emulator.py) that runs every packet of an emulated host through
one `DelayLine` per direction. Delay is per direction and between the host and the lab's core (the
bridge): two emulated hosts A and B see an RTT of 2 * (delay_A + delay_B).
"""

from __future__ import annotations

import heapq
import math
import random
from dataclasses import asdict, dataclass

from hetnode.errors import HetnodeError


class LinkProfileError(HetnodeError):
    """A link profile asks for something a link cannot be (negative, absurd, or an unknown preset)."""


MAX_MBIT = 100_000.0  # 100 Gbit/s: beyond that it is a typo, not a home link
MAX_DELAY_MS = 5_000.0  # one way; a geostationary hop is ~300 ms
MAX_LOSS = 0.5  # a link losing more than every other packet is not a link a run should start on


@dataclass(frozen=True)
class LinkProfile:
    """One host's link to the lab's core. `None` rates are unshaped; `delay_ms` is one way, per direction,
    so the RTT to an unemulated host is 2 * delay_ms; jitter is +- uniform on top of it; `loss` is the
    chance that a packet is dropped, per packet and per direction. Jitter never reorders packets unless
    `reorder` is set (a later packet otherwise waits for the one ahead of it, as on a single path)."""

    down_mbit: float | None = None
    up_mbit: float | None = None
    delay_ms: float = 0.0
    jitter_ms: float = 0.0
    loss: float = 0.0
    reorder: bool = False

    def __post_init__(self) -> None:
        for key in ("down_mbit", "up_mbit"):
            rate = getattr(self, key)
            if rate is not None and not (_finite(rate) and 0.01 <= rate <= MAX_MBIT):
                raise LinkProfileError(f"{key}={rate!r}: a rate is between 0.01 and {MAX_MBIT:g} Mbit/s")
        for key in ("delay_ms", "jitter_ms"):
            value = getattr(self, key)
            if not (_finite(value) and 0.0 <= value <= MAX_DELAY_MS):
                raise LinkProfileError(f"{key}={value!r}: between 0 and {MAX_DELAY_MS:g} ms one way")
        if self.jitter_ms > self.delay_ms:
            raise LinkProfileError(
                f"jitter_ms={self.jitter_ms} > delay_ms={self.delay_ms}: a packet cannot leave before it came"
            )
        if not (_finite(self.loss) and 0.0 <= self.loss <= MAX_LOSS):
            raise LinkProfileError(f"loss={self.loss!r}: a share between 0 and {MAX_LOSS} (0.01 is 1 %)")

    @property
    def emulated(self) -> bool:
        """Whether packets must pass through the user-space emulator (tc alone does the rates)."""
        return self.delay_ms > 0 or self.jitter_ms > 0 or self.loss > 0

    @property
    def rtt_ms(self) -> float:
        """The RTT this link adds between its host and the core (an unemulated host)."""
        return 2 * self.delay_ms

    def as_dict(self) -> dict[str, float | bool | None]:
        return asdict(self)


def _finite(value: float) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


PRESETS: dict[str, LinkProfile] = {
    "lan": LinkProfile(),  # a plain veth: > 1 Gbit/s, ~0.05 ms
    "home-cable": LinkProfile(down_mbit=100, up_mbit=20, delay_ms=10, jitter_ms=2),
    "dsl": LinkProfile(down_mbit=25, up_mbit=5, delay_ms=20, jitter_ms=3),
    "mobile": LinkProfile(down_mbit=30, up_mbit=10, delay_ms=35, jitter_ms=10, loss=0.005),
    "far": LinkProfile(down_mbit=50, up_mbit=50, delay_ms=75, jitter_ms=1),  # another continent: ~150 ms RTT
    # a fast host on another continent: the lab's anchor rate, 150 ms RTT to the core (the soak's far anchor)
    "far-fast": LinkProfile(down_mbit=100, up_mbit=100, delay_ms=75, jitter_ms=1),
}


def describe(profile: LinkProfile) -> str:
    """'100/20 Mbit/s, 20 ms RTT' (down/up), '100 Mbit/s, lan' for a symmetric link with no delay."""
    down, up = (f"{r:g}" if r is not None else "unshaped" for r in (profile.down_mbit, profile.up_mbit))
    rate = f"{down} Mbit/s" if down == up else f"{down}/{up} Mbit/s"
    return f"{rate}, {profile.rtt_ms:g} ms RTT" if profile.emulated else f"{rate}, lan"


def link_profile(spec: LinkProfile | str | float | None) -> LinkProfile:
    """A host's profile from what NetLab accepts: a profile, a preset name, or (as before profiles) a
    symmetric rate in Mbit/s or None for an unshaped link."""
    if isinstance(spec, LinkProfile):
        return spec
    if isinstance(spec, str):
        if spec not in PRESETS:
            raise LinkProfileError(f"no link preset {spec!r}; presets: {', '.join(PRESETS)}")
        return PRESETS[spec]
    if spec is None:
        return PRESETS["lan"]
    return LinkProfile(down_mbit=spec, up_mbit=spec)


class DelayLine:
    """One direction of one link: `push` a packet that arrived at `now` (False: lost), `pop_due` the
    packets whose time has come, in the order they leave. Times are seconds on any monotonic clock."""

    def __init__(
        self,
        delay_s: float,
        jitter_s: float = 0.0,
        loss: float = 0.0,
        *,
        reorder: bool = False,
        rng: random.Random | None = None,
        max_packets: int = 20_000,
    ) -> None:
        self.delay_s = delay_s
        self.jitter_s = jitter_s
        self.loss = loss
        self.reorder = reorder
        self.rng = rng or random.Random(0)
        self.max_packets = max_packets  # ~30 MB of full frames; beyond it the line drops (tail drop)
        self._heap: list[tuple[float, int, bytes]] = []
        self._seq = 0
        self._last_due = -math.inf
        self.passed = 0
        self.lost = 0
        self.overflowed = 0

    def push(self, now: float, packet: bytes) -> bool:
        # the loss draw comes first and always happens, so a seed fixes which packets are lost
        if self.loss > 0 and self.rng.random() < self.loss:
            self.lost += 1
            return False
        if len(self._heap) >= self.max_packets:
            self.overflowed += 1
            return False
        due = now + self.delay_s
        if self.jitter_s > 0:
            due += self.rng.uniform(-self.jitter_s, self.jitter_s)
        if not self.reorder:
            due = max(due, self._last_due)  # FIFO: never overtake the packet ahead
            self._last_due = due
        heapq.heappush(self._heap, (due, self._seq, packet))
        self._seq += 1
        return True

    def next_due(self) -> float | None:
        return self._heap[0][0] if self._heap else None

    def pop_due(self, now: float) -> list[bytes]:
        out = []
        while self._heap and self._heap[0][0] <= now:
            out.append(heapq.heappop(self._heap)[2])
        self.passed += len(out)
        return out

    def __len__(self) -> int:
        return len(self._heap)
