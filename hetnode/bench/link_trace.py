"""Every lab link's bytes over time, from the hub's side: what each host sent and received, every few tenths
of a second, so a round's sync window can be read as link utilisation (is the busiest uplink full, and
with what).

One process inside the hub namespace prints /proc/net/dev in a loop (one spawn for the whole run, not one
per host and sample: ten hosts sampled five times a second would otherwise cost fifty spawns a second on
the cores the daemons run on). The hub's end of a host's link receives what the host uploads and sends
what it downloads.
"""

from __future__ import annotations

import bisect
import subprocess
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

MARK = "--sample"


@dataclass
class LinkTrace:
    """Samples of (time, {host: (uploaded, downloaded) bytes so far})."""

    times: list[float] = field(default_factory=list)
    counters: list[dict[str, tuple[int, int]]] = field(default_factory=list)

    def bytes_between(self, host: str, start: float, end: float) -> tuple[float, float]:
        """(uploaded, downloaded) bytes of `host` from `start` to `end`, interpolated between samples."""
        up = self._at(host, end, 0) - self._at(host, start, 0)
        down = self._at(host, end, 1) - self._at(host, start, 1)
        return up, down

    def _at(self, host: str, when: float, side: int) -> float:
        i = bisect.bisect_left(self.times, when)
        if i == 0:
            return float(self.counters[0][host][side])
        if i >= len(self.times):
            return float(self.counters[-1][host][side])
        t0, t1 = self.times[i - 1], self.times[i]
        c0, c1 = self.counters[i - 1][host][side], self.counters[i][host][side]
        return c0 + (c1 - c0) * (when - t0) / (t1 - t0) if t1 > t0 else float(c1)

    def rates_mbit(self, host: str, start: float, end: float, step_s: float) -> list[tuple[float, float]]:
        """(upload, download) Mbit/s of `host` in consecutive `step_s` slices from `start` to `end`."""
        out = []
        t = start
        while t + step_s <= end + 1e-9:
            up, down = self.bytes_between(host, t, t + step_s)
            out.append((up * 8 / step_s / 1e6, down * 8 / step_s / 1e6))
            t += step_s
        return out

    def to_json(self, hosts: Sequence[str]) -> dict:
        return {
            "times": self.times,
            "up": {h: [c[h][0] for c in self.counters] for h in hosts},
            "down": {h: [c[h][1] for c in self.counters] for h in hosts},
        }


class LinkTracer:
    """`with LinkTracer(hub_namespace, {host: hub device}) as trace:` samples until the block ends."""

    def __init__(self, namespace: str, devices: Mapping[str, str], period_s: float = 0.2) -> None:
        self.namespace = namespace
        self.hosts_of = {device: host for host, device in devices.items()}
        self.period_s = period_s
        self.trace = LinkTrace()
        self._process: subprocess.Popen | None = None
        self._reader: threading.Thread | None = None

    def __enter__(self) -> LinkTrace:
        script = f"while :; do echo {MARK}; cat /proc/net/dev; sleep {self.period_s}; done"
        self._process = subprocess.Popen(
            ["ip", "netns", "exec", self.namespace, "sh", "-c", script],
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
        )
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()
        return self.trace

    def __exit__(self, *exc: object) -> None:
        if self._process is not None:
            self._process.kill()
            self._process.wait(10)
        if self._reader is not None:
            self._reader.join(10)

    def _read(self) -> None:
        assert self._process is not None and self._process.stdout is not None
        current: dict[str, tuple[int, int]] = {}
        taken = time.time()
        for line in self._process.stdout:
            if line.startswith(MARK):  # the counters that follow are read now
                self._keep(taken, current)
                current, taken = {}, time.time()
                continue
            name, _, counters = line.partition(":")
            host = self.hosts_of.get(name.strip())
            if host is not None and counters:
                fields = counters.split()
                current[host] = (int(fields[0]), int(fields[8]))  # the hub's rx: the host's upload
        self._keep(taken, current)

    def _keep(self, taken: float, sample: dict[str, tuple[int, int]]) -> None:
        # a sample cut short (the process killed mid-print) lacks hosts: it is dropped
        if sample and set(sample) == set(self.hosts_of.values()):
            self.trace.times.append(taken)
            self.trace.counters.append(sample)
