"""A network lab on one machine: one Linux network namespace per host, all joined by a bridge in a hub
namespace, each link shaped with `tc` (root only).

Every host gets a veth pair: one end in its namespace (address 10.<net>.0.<n>/24), the other in the hub,
enslaved to the bridge. A shaped host has a token bucket on both ends, so its upload (its own egress) and
its download (the hub side's egress toward it) are both limited to the rate. Nothing here touches the
root namespace: deleting the namespaces removes everything.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import uuid
from dataclasses import dataclass

from hetnode.errors import HetnodeError


class LabUnavailable(HetnodeError):
    """The machine cannot build the lab (not root, or no `ip`/`tc`)."""


@dataclass(frozen=True)
class Host:
    name: str
    namespace: str
    address: str
    device: str  # the host's end of its link, inside its namespace
    rate_mbit: float | None  # None: unshaped (a veth moves > 1 Gbit/s here)

    @property
    def prefix(self) -> list[str]:
        """Run a command inside this host's namespace."""
        return ["ip", "netns", "exec", self.namespace]


def _sh(*args: str) -> None:
    result = subprocess.run(args, capture_output=True, text=True, timeout=30)
    if result.returncode != 0:
        raise HetnodeError(f"`{' '.join(args)}` failed: {result.stderr.strip()}")


def check_lab_possible() -> None:
    if os.geteuid() != 0:
        raise LabUnavailable("the network lab needs root (network namespaces and tc)")
    missing = [tool for tool in ("ip", "tc") if shutil.which(tool) is None]
    if missing:
        raise LabUnavailable(f"the network lab needs {' and '.join(missing)} (package iproute2)")


class NetLab:
    """`with NetLab({"coord": None, "edge": 20.0}) as lab:` builds the hosts; leaving removes them."""

    def __init__(self, rates_mbit: dict[str, float | None], net: int | None = None) -> None:
        if len(rates_mbit) > 200:
            raise ValueError("at most 200 hosts")
        self.tag = uuid.uuid4().hex[:6]
        net = net if net is not None else 100 + int(self.tag[:2], 16) % 100
        self.hub = f"hnl-hub-{self.tag}"
        self.hosts = {
            name: Host(name, f"hnl-{i}-{self.tag}", f"10.{net}.0.{i + 1}", f"e{i}{self.tag}", rate)
            for i, (name, rate) in enumerate(rates_mbit.items())
        }
        self._namespaces: list[str] = []

    def __enter__(self) -> NetLab:
        check_lab_possible()
        try:
            self._build()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _build(self) -> None:
        _sh("ip", "netns", "add", self.hub)
        self._namespaces.append(self.hub)
        _sh("ip", "-n", self.hub, "link", "add", "br0", "type", "bridge")
        _sh("ip", "-n", self.hub, "link", "set", "br0", "up")
        for i, host in enumerate(self.hosts.values()):
            _sh("ip", "netns", "add", host.namespace)
            self._namespaces.append(host.namespace)
            hub_end = f"h{i}{self.tag}"
            _sh("ip", "link", "add", host.device, "type", "veth", "peer", "name", hub_end)
            _sh("ip", "link", "set", host.device, "netns", host.namespace)
            _sh("ip", "link", "set", hub_end, "netns", self.hub)
            _sh("ip", "-n", self.hub, "link", "set", hub_end, "master", "br0")
            _sh("ip", "-n", self.hub, "link", "set", hub_end, "up")
            _sh("ip", "-n", host.namespace, "addr", "add", f"{host.address}/24", "dev", host.device)
            _sh("ip", "-n", host.namespace, "link", "set", host.device, "up")
            _sh("ip", "-n", host.namespace, "link", "set", "lo", "up")
            if host.rate_mbit is not None:
                for namespace, device in ((host.namespace, host.device), (self.hub, hub_end)):
                    _shape(namespace, device, host.rate_mbit)

    def close(self) -> None:
        for namespace in reversed(self._namespaces):
            subprocess.run(["ip", "netns", "del", namespace], capture_output=True, timeout=30)
        self._namespaces.clear()

    def interface_bytes(self, host: str) -> tuple[int, int]:
        """(received, sent) bytes so far on the host's link, from its namespace's /proc/net/dev."""
        h = self.hosts[host]
        text = subprocess.run(
            [*h.prefix, "cat", "/proc/net/dev"], capture_output=True, text=True, timeout=30, check=True
        ).stdout
        return parse_net_dev(text, h.device)


def _shape(namespace: str, device: str, rate_mbit: float) -> None:
    # burst: at least one MTU-sized packet and ~1 ms of traffic; latency bounds the queue (bufferbloat)
    burst_bytes = max(4096, int(rate_mbit * 1e6 / 8 / 1000))
    _sh(
        "ip",
        "netns",
        "exec",
        namespace,
        "tc",
        "qdisc",
        "add",
        "dev",
        device,
        "root",
        "tbf",
        "rate",
        f"{rate_mbit}mbit",
        "burst",
        str(burst_bytes),
        "latency",
        "200ms",
    )


def parse_net_dev(text: str, device: str) -> tuple[int, int]:
    """(rx_bytes, tx_bytes) of `device` in /proc/net/dev text."""
    for line in text.splitlines():
        name, _, counters = line.partition(":")
        if name.strip() == device and counters:
            fields = counters.split()
            return int(fields[0]), int(fields[8])
    raise HetnodeError(f"no interface {device} in /proc/net/dev")
