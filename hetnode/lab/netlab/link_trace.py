"""Every lab link's bytes over time, from the hub's side: what each host sent and received, every few tenths
of a second, so a round's sync window can be read as link utilisation (is the busiest uplink full, and
with what); how busy each CPU core was (the lab pins its daemons to cores), to tell a round waiting on its
links from one waiting on its cores; and the CPU time of every daemon and p2pd, to say what kept a core busy.

One process inside the hub namespace prints /proc/net/dev in a loop (one spawn for the whole run, not one
per host and sample: ten hosts sampled five times a second would otherwise cost fifty spawns a second on
the cores the daemons run on). The hub's end of a host's link receives what the host uploads and sends
what it downloads.
"""

from __future__ import annotations

import bisect
import os
import subprocess
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

MARK = "--sample"
TRACED = ("python", "python3", "python3.11", "p2pd")  # process names whose CPU time is kept
CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


@dataclass
class LinkTrace:
    """Samples of (time, {host: (uploaded, downloaded) bytes so far}, {core: (busy, all) jiffies so far})."""

    times: list[float] = field(default_factory=list)
    counters: list[dict[str, tuple[int, int]]] = field(default_factory=list)
    cores: list[dict[str, tuple[int, int]]] = field(default_factory=list)
    processes: list[dict[int, tuple[int, int]]] = field(default_factory=list)  # pid -> (parent, CPU ticks)

    def bytes_between(self, host: str, start: float, end: float) -> tuple[float, float]:
        """(uploaded, downloaded) bytes of `host` from `start` to `end`, interpolated between samples."""
        up = self._at(host, end, 0) - self._at(host, start, 0)
        down = self._at(host, end, 1) - self._at(host, start, 1)
        return up, down

    def core_busy(self, core: str, start: float, end: float) -> float | None:
        """The share of `start`..`end` that `core` ("cpu0", …) was busy, None when it was not sampled."""
        if not self.cores or core not in self.cores[0]:
            return None
        busy = self._at(core, end, 0, self.cores) - self._at(core, start, 0, self.cores)
        total = self._at(core, end, 1, self.cores) - self._at(core, start, 1, self.cores)
        return busy / total if total > 0 else None

    def _at(self, name: str, when: float, side: int, series: list | None = None) -> float:
        series = self.counters if series is None else series
        i = bisect.bisect_left(self.times, when)
        if i == 0:
            return float(series[0][name][side])
        if i >= len(self.times):
            return float(series[-1][name][side])
        t0, t1 = self.times[i - 1], self.times[i]
        c0, c1 = series[i - 1][name][side], series[i][name][side]
        return c0 + (c1 - c0) * (when - t0) / (t1 - t0) if t1 > t0 else float(c1)

    def cpu_seconds(self, pid: int, start: float, end: float) -> float:
        """CPU time process `pid` used from `start` to `end` (0 where it was not sampled)."""
        return (self._ticks_at(pid, end) - self._ticks_at(pid, start)) / CLOCK_TICKS

    def _ticks_at(self, pid: int, when: float) -> float:
        i = min(bisect.bisect_left(self.times, when), len(self.times) - 1)
        before = self.processes[i - 1].get(pid) if i > 0 else None
        after = self.processes[i].get(pid)
        if before is None or after is None:
            found = after or before
            return float(found[1]) if found else 0.0
        t0, t1 = self.times[i - 1], self.times[i]
        share = min(max((when - t0) / (t1 - t0), 0.0), 1.0) if t1 > t0 else 1.0
        return before[1] + (after[1] - before[1]) * share

    def children_of(self, pid: int) -> set[int]:
        """Processes sampled with `pid` as their parent (a daemon's p2pd)."""
        return {child for sample in self.processes for child, (parent, _) in sample.items() if parent == pid}

    def core_names(self) -> list[str]:
        return sorted(self.cores[0]) if self.cores else []

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
            "cores": {k: [c[k] for c in self.cores] for k in self.core_names()},
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
        # /proc/stat is the machine's whatever the namespace: its per-core lines, beside the hub's links
        script = (
            f"while :; do echo {MARK}; cat /proc/net/dev; grep '^cpu[0-9]' /proc/stat; "
            f"cat /proc/[0-9]*/stat 2>/dev/null; sleep {self.period_s}; done"
        )
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
        cores: dict[str, tuple[int, int]] = {}
        processes: dict[int, tuple[int, int]] = {}
        taken = time.time()
        for line in self._process.stdout:
            if line.startswith(MARK):  # the counters that follow are read now
                self._keep(taken, current, cores, processes)
                current, cores, processes, taken = {}, {}, {}, time.time()
                continue
            if line[:1].isdigit():  # /proc/<pid>/stat: pid (name) state ppid … utime stime (fields 14, 15)
                name, rest = line[line.find("(") + 1 : line.rfind(")")], line[line.rfind(")") + 2 :].split()
                if name in TRACED and len(rest) > 12:
                    processes[int(line.split(" ", 1)[0])] = (int(rest[1]), int(rest[11]) + int(rest[12]))
                continue
            if line.startswith("cpu"):  # user nice system idle iowait irq softirq steal …
                name, *jiffies = line.split()
                values = [int(v) for v in jiffies[:8]]
                cores[name] = (sum(values) - values[3] - values[4], sum(values))
                continue
            name, _, counters = line.partition(":")
            host = self.hosts_of.get(name.strip())
            if host is not None and counters:
                fields = counters.split()
                current[host] = (int(fields[0]), int(fields[8]))  # the hub's rx: the host's upload
        self._keep(taken, current, cores, processes)

    def _keep(
        self,
        taken: float,
        sample: dict[str, tuple[int, int]],
        cores: dict[str, tuple[int, int]],
        processes: dict[int, tuple[int, int]],
    ) -> None:
        # a sample cut short (the process killed mid-print) lacks hosts or cores: it is dropped
        if not sample or set(sample) != set(self.hosts_of.values()):
            return
        if self.trace.cores and set(cores) != set(self.trace.cores[0]):
            return
        self.trace.times.append(taken)
        self.trace.counters.append(sample)
        self.trace.cores.append(cores)
        self.trace.processes.append(processes)
