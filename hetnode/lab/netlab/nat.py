"""The network lab with home routers: a host behind a masquerading NAT, as a volunteer at home is.

`NatLab({"coord": None, "home": None}, behind_nat={"volunteer": "home"})` builds the lab's hosts on the
bridge, then puts "volunteer" in its own namespace on a private subnet (192.168.<k>.0/24) whose only way
out is the lab host "home", which forwards and masquerades onto the bridge (iptables MASQUERADE, no port
forward). Hosts on the bridge cannot open a connection to the volunteer; it can connect out to them, and
they see the router's address. Everything lives in namespaces the lab made: leaving deletes it.
"""

from __future__ import annotations

import shutil
from collections.abc import Mapping

from hetnode.lab.netlab.hosts import Host, LabUnavailable, LinkSpec, NetLab, _sh, check_lab_possible


def check_nat_possible() -> None:
    check_lab_possible()
    if shutil.which("iptables") is None:
        raise LabUnavailable("a NAT router in the lab needs iptables (package iptables)")


class NatLab(NetLab):
    """A NetLab whose `behind_nat` hosts (name -> the lab host that is their router) sit behind NAT."""

    def __init__(
        self,
        rates_mbit: Mapping[str, LinkSpec],
        behind_nat: dict[str, str],
        net: int | None = None,
    ) -> None:
        super().__init__(rates_mbit, net)
        unknown = {router for router in behind_nat.values() if router not in rates_mbit}
        if unknown or set(behind_nat) & set(rates_mbit):
            raise ValueError(f"routers must be lab hosts and NAT'd names new ones: {behind_nat}")
        self.routers = dict(behind_nat)
        # joined to `hosts` once the bridge hosts are built (NetLab builds every host in `hosts`)
        self._behind = {
            name: Host(name, f"hnl-n{k}-{self.tag}", f"192.168.{k}.2", f"n{k}{self.tag}", None)
            for k, name in enumerate(behind_nat, start=1)
        }

    def __enter__(self) -> NatLab:
        check_nat_possible()
        super().__enter__()
        try:
            for k, (name, router) in enumerate(self.routers.items(), start=1):
                self.hosts[name] = self._behind[name]
                self._put_behind(self.hosts[name], self.hosts[router], k)
        except BaseException:
            self.close()
            raise
        return self

    def _put_behind(self, host: Host, router: Host, k: int) -> None:
        _sh("ip", "netns", "add", host.namespace)
        self._namespaces.append(host.namespace)
        lan = f"l{k}{self.tag}"  # the router's end of the home LAN
        _sh("ip", "link", "add", host.device, "type", "veth", "peer", "name", lan)
        _sh("ip", "link", "set", host.device, "netns", host.namespace)
        _sh("ip", "link", "set", lan, "netns", router.namespace)
        _sh("ip", "-n", router.namespace, "addr", "add", f"192.168.{k}.1/24", "dev", lan)
        _sh("ip", "-n", router.namespace, "link", "set", lan, "up")
        _sh("ip", "-n", host.namespace, "addr", "add", f"{host.address}/24", "dev", host.device)
        _sh("ip", "-n", host.namespace, "link", "set", host.device, "up")
        _sh("ip", "-n", host.namespace, "link", "set", "lo", "up")
        _sh("ip", "-n", host.namespace, "route", "add", "default", "via", f"192.168.{k}.1")
        _sh(*router.prefix, "sysctl", "-qw", "net.ipv4.ip_forward=1")
        nat = ["iptables", "-t", "nat", "-A", "POSTROUTING", "-s", f"192.168.{k}.0/24"]
        _sh(*router.prefix, *nat, "-o", router.device, "-j", "MASQUERADE")
