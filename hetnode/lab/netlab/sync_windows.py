"""What every lab link carried while a round synchronised, from the link trace and the daemons' round logs.

A round's sync has two windows: from the last replica's announcement to the first replica holding the
seal (validation downloads, the seal's check and aggregation, the seal reaching the replicas), and from
there to the last replica holding every sealed payload (the fetches). Per host and window: the bytes it
sent and received and how full that kept its link. A link that is full for the whole fetch window
carried more than the sealed payloads when it sent more than them: that surplus is what else shares the
link (DHT replies, activations), the term a model of the payloads alone leaves out.
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from hetnode.lab.netlab.link_trace import LinkTrace


def round_windows(logs: Mapping[str, Sequence[dict]], rounds: Sequence[int]) -> dict[int, dict[str, float]]:
    """Per round with included replicas: `announced` (the last announcement), `sealed` (the first replica
    holding the seal), `fetched` (the last holding every payload), as wall-clock times."""
    out = {}
    for n in rounds:
        records = [r for rs in logs.values() for r in rs if r["round"] == n and r["included"] and "time" in r]
        if records:
            out[n] = {
                "announced": max(r["time"] for r in records),
                "sealed": min(r["time"] + r["seal_wait_s"] for r in records),
                "fetched": max(r["time"] + r["seal_wait_s"] + r["fetch_s"] for r in records),
            }
    return out


SPANS = {"sealing": ("announced", "sealed"), "fetching": ("sealed", "fetched")}


def window_cores(trace: LinkTrace, windows: Mapping[int, Mapping[str, float]]) -> dict[str, dict[str, float]]:
    """{window: {core: the median over rounds of the share of the window it was busy}}."""
    out: dict[str, dict[str, float]] = {}
    for window, (start, end) in SPANS.items():
        for core in trace.core_names():
            shares = [
                share
                for w in windows.values()
                if w[end] > w[start] and (share := trace.core_busy(core, w[start], w[end])) is not None
            ]
            if shares:
                out.setdefault(window, {})[core] = statistics.median(shares)
    return out


def window_cpu(
    trace: LinkTrace, windows: Mapping[int, Mapping[str, float]], pids: Mapping[str, int]
) -> dict[str, dict[str, dict[str, float]]]:
    """{window: {daemon: medians over rounds of its own CPU seconds (`daemon_s`), its p2pd's (`p2pd_s`)
    and the window's length}}: what kept the cores busy."""
    p2pds = {name: trace.children_of(pid) for name, pid in pids.items()}
    out: dict[str, dict[str, dict[str, float]]] = {}
    for window, (start, end) in SPANS.items():
        for name, pid in pids.items():
            spans = [(w[start], w[end]) for w in windows.values() if w[end] > w[start]]
            if not spans:
                continue
            own = [trace.cpu_seconds(pid, a, b) for a, b in spans]
            helpers = [sum(trace.cpu_seconds(child, a, b) for child in p2pds[name]) for a, b in spans]
            out.setdefault(window, {})[name] = {
                "seconds": statistics.median(b - a for a, b in spans),
                "daemon_s": statistics.median(own),
                "p2pd_s": statistics.median(helpers),
            }
    return out


def window_load(
    trace: LinkTrace, windows: Mapping[int, Mapping[str, float]], rates_mbit: Mapping[str, float]
) -> dict[str, dict[str, dict[str, float]]]:
    """{window ("sealing", "fetching"): {host: medians over rounds of seconds, bytes up and down, and the
    share of its link each direction used}}."""
    out: dict[str, dict[str, dict[str, float]]] = {}
    for window, (start, end) in SPANS.items():
        per_host: dict[str, dict[str, list[float]]] = {}
        for w in windows.values():
            seconds = w[end] - w[start]
            if seconds <= 0:
                continue
            for host, rate in rates_mbit.items():
                up, down = trace.bytes_between(host, w[start], w[end])
                capacity = rate * 1e6 / 8 * seconds
                values = {
                    "seconds": seconds,
                    "up_bytes": up,
                    "down_bytes": down,
                    "up_share": up / capacity,
                    "down_share": down / capacity,
                }
                for key, value in values.items():
                    per_host.setdefault(host, {}).setdefault(key, []).append(value)
        out[window] = {
            host: {key: statistics.median(v) for key, v in values.items()}
            for host, values in per_host.items()
        }
    return out


def plot_round(
    trace: LinkTrace,
    window: Mapping[str, float],
    rates_mbit: Mapping[str, float],
    path: Path,
    title: str,
    step_s: float = 0.4,
) -> None:
    """Every host's upload and download rate, and every core's load, through one round's sync, the windows'
    edges marked: `path` (PNG)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    start, end = window["announced"] - 3.0, window["fetched"] + 3.0
    cores = trace.core_names()
    fig, axes = plt.subplots(3 if cores else 2, 1, figsize=(10, 9 if cores else 6.5), sharex=True)
    offset = window["announced"] - start
    for ax, side, label in ((axes[0], 0, "upload"), (axes[1], 1, "download")):
        for host in rates_mbit:
            rates = trace.rates_mbit(host, start, end, step_s)
            xs = [i * step_s + step_s / 2 - offset for i in range(len(rates))]
            style = "-" if host.startswith("stage") else (":" if host == "coordinator" else "--")
            ax.plot(xs, [r[side] for r in rates], style, label=host, linewidth=1.2)
        for edge, colour in (("announced", "grey"), ("sealed", "black"), ("fetched", "red")):
            ax.axvline(window[edge] - window["announced"], color=colour, linewidth=0.8)
        ax.set_ylabel(f"{label}, Mbit/s")
        ax.grid(alpha=0.3)
    if cores:
        ax = axes[2]
        steps = int((end - start) / step_s)
        xs = [i * step_s + step_s / 2 - offset for i in range(steps)]
        for core in cores:
            busy = [trace.core_busy(core, start + i * step_s, start + (i + 1) * step_s) for i in range(steps)]
            ax.plot(xs, [100 * (b or 0.0) for b in busy], label=core, linewidth=1.2)
        for edge, colour in (("announced", "grey"), ("sealed", "black"), ("fetched", "red")):
            ax.axvline(window[edge] - window["announced"], color=colour, linewidth=0.8)
        ax.set_ylabel("core busy, %")
        ax.set_ylim(0, 105)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    axes[0].set_title(title + "\n(grey: last announcement, black: first seal held, red: last fetch done)")
    axes[-1].set_xlabel("seconds from the last announcement")
    axes[0].legend(fontsize=7, ncol=4)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def summary(load: Mapping[str, Mapping[str, Mapping[str, float]]], classes: Mapping[str, list[str]]) -> Any:
    """Per window and class (anchors, each stage, the coordinator): the median host's figures."""
    out: dict[str, dict[str, dict[str, float]]] = {}
    for window, hosts in load.items():
        for cls, names in classes.items():
            present = [hosts[n] for n in names if n in hosts]
            if present:
                keys = present[0].keys()
                out.setdefault(window, {})[cls] = {k: statistics.median(h[k] for h in present) for k in keys}
    return out
