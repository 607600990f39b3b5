"""A network lab on one machine: one Linux network namespace per host, all joined by a bridge in a hub
namespace, each link shaped with `tc` (root only).

Every host gets a link: one end in its namespace (address 10.<net>.0.<n>/24), the other in the hub,
enslaved to the bridge. A shaped host has a token bucket on both ends, so its upload (its own egress) and
its download (the hub side's egress toward it) are limited to its profile's up and down rates. A plain
link is a veth pair; a host whose profile asks for delay, jitter or loss gets a pair of TAP devices
instead, joined by the lab's user-space WAN emulator (hetnode/lab/netlab/wan_emulator.py; there is no netem).
Nothing here touches the root namespace: deleting the namespaces removes everything.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import uuid
from collections.abc import Mapping
from dataclasses import dataclass

from hetnode.errors import HetnodeError
from hetnode.lab.netlab.wan import LinkProfile, link_profile
from hetnode.lab.netlab.wan_emulator import EmulatedLink, Emulator

# what NetLab takes per host: a profile, a preset name ("home-cable"), a symmetric Mbit/s rate, or None
LinkSpec = LinkProfile | str | float | None


class LabUnavailable(HetnodeError):
    """The machine cannot build the lab (not root, or no `ip`/`tc`)."""


@dataclass(frozen=True)
class Host:
    name: str
    namespace: str
    address: str
    device: str  # the host's end of its link, inside its namespace
    rate_mbit: float | None  # the download rate; None: unshaped (a veth moves > 1 Gbit/s here)
    profile: LinkProfile | None = None  # None: unshaped both ways, no delay

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


def lab_unavailable() -> str:
    """Why the lab cannot be built here ("" when it can): for tests that skip without it."""
    try:
        check_lab_possible()
    except LabUnavailable as exc:
        return str(exc)
    return ""


class NetLab:
    """`with NetLab({"coord": None, "edge": 20.0, "home": "home-cable"}) as lab:` builds the hosts;
    leaving removes them. Per host: a LinkProfile, a preset name of hetnode.lab.netlab.wan.PRESETS, a
    symmetric rate in Mbit/s, or None (unshaped). `seed` fixes the emulator's jitter and loss draws."""

    def __init__(self, rates_mbit: Mapping[str, LinkSpec], net: int | None = None, seed: int = 0) -> None:
        if len(rates_mbit) > 200:
            raise ValueError("at most 200 hosts")
        self.tag = uuid.uuid4().hex[:6]
        self.seed = seed
        net = net if net is not None else 100 + int(self.tag[:2], 16) % 100
        self.hub = f"hnl-hub-{self.tag}"
        self.hosts = {}
        for i, (name, spec) in enumerate(rates_mbit.items()):
            profile = link_profile(spec)
            address, device = f"10.{net}.0.{i + 1}", f"e{i}{self.tag}"
            self.hosts[name] = Host(name, f"hnl-{i}-{self.tag}", address, device, profile.down_mbit, profile)
        self._namespaces: list[str] = []
        self.emulator: Emulator | None = None
        self.hub_devices: dict[str, str] = {}  # host -> its link's end in the hub (what it sends, received)

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
        self._namespaces.append(self.hub)  # noted first: cut short right after, close() still finds it
        _sh("ip", "netns", "add", self.hub)
        _sh("ip", "-n", self.hub, "link", "add", "br0", "type", "bridge")
        _sh("ip", "-n", self.hub, "link", "set", "br0", "up")
        emulated = []
        for i, (name, host) in enumerate(self.hosts.items()):
            self._namespaces.append(host.namespace)
            _sh("ip", "netns", "add", host.namespace)
            hub_end = f"h{i}{self.tag}"
            if host.profile is not None and host.profile.emulated:
                link = EmulatedLink(host.namespace, host.device, self.hub, hub_end, host.profile)
                emulated.append(link)
                self.hub_devices[name] = link.hub_device
                continue  # its taps come from the emulator, below
            _sh("ip", "link", "add", host.device, "type", "veth", "peer", "name", hub_end)
            _sh("ip", "link", "set", host.device, "netns", host.namespace)
            _sh("ip", "link", "set", hub_end, "netns", self.hub)
            self.hub_devices[name] = hub_end
            self._attach(host, hub_end)
        if emulated:
            self.emulator = Emulator(emulated, self.tag, self.seed)
            hosts = {host.namespace: host for host in self.hosts.values()}
            for link in emulated:
                self._attach(hosts[link.host_namespace], link.hub_device)

    def _attach(self, host: Host, hub_end: str) -> None:
        """Join the host's link to the bridge, give it its address, and shape each direction."""
        _sh("ip", "-n", self.hub, "link", "set", hub_end, "master", "br0")
        _sh("ip", "-n", self.hub, "link", "set", hub_end, "up")
        _sh("ip", "-n", host.namespace, "addr", "add", f"{host.address}/24", "dev", host.device)
        _sh("ip", "-n", host.namespace, "link", "set", host.device, "up")
        _sh("ip", "-n", host.namespace, "link", "set", "lo", "up")
        profile = host.profile or LinkProfile()
        for namespace, device, rate in (
            (host.namespace, host.device, profile.up_mbit),  # the host's egress: its upload
            (self.hub, hub_end, profile.down_mbit),  # the bridge's egress toward it: its download
        ):
            if rate is not None:
                _shape(namespace, device, rate)

    def close(self) -> None:
        if self.emulator is not None:  # first: its taps go with it, and it must not outlive the lab
            self.emulator.stop()
            self.emulator = None
        # a process still inside keeps its namespace, and the veth in it, alive after `ip netns del` (a
        # daemon that ignored SIGTERM, the p2pd of a killed one): all of them are ours, as the namespaces are
        for namespace in reversed(self._namespaces):
            kill_inside(namespace)
            subprocess.run(["ip", "netns", "del", namespace], capture_output=True, timeout=30)
        self._namespaces.clear()
        for link in stray_links(self.tag):  # a pair made but not yet moved when the build was cut short
            subprocess.run(["ip", "link", "del", link], capture_output=True, timeout=30)

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


def kill_inside(namespace: str) -> None:
    """SIGKILL every process in `namespace`."""
    listed = subprocess.run(["ip", "netns", "pids", namespace], capture_output=True, text=True, timeout=30)
    for pid in listed.stdout.split():
        with contextlib.suppress(ProcessLookupError, ValueError):
            os.kill(int(pid), signal.SIGKILL)


def lab_namespaces(tag: str) -> list[str]:
    """The namespaces of the lab `tag` that exist now."""
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, timeout=30).stdout
    return [line.split()[0] for line in listed.splitlines() if line.split() and line.split()[0].endswith(tag)]


def stray_links(tag: str) -> list[str]:
    """Links of the lab `tag` in the root namespace (every lab device's name ends with the tag)."""
    listed = subprocess.run(["ip", "-o", "link", "show"], capture_output=True, text=True, timeout=30).stdout
    names = [line.split(":")[1].strip().split("@")[0] for line in listed.splitlines() if line.count(":") >= 2]
    return [name for name in names if name.endswith(tag)]


def parse_net_dev(text: str, device: str) -> tuple[int, int]:
    """(rx_bytes, tx_bytes) of `device` in /proc/net/dev text."""
    for line in text.splitlines():
        name, _, counters = line.partition(":")
        if name.strip() == device and counters:
            fields = counters.split()
            return int(fields[0]), int(fields[8])
    raise HetnodeError(f"no interface {device} in /proc/net/dev")
