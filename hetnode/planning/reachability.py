"""Can the swarm dial this peer back? A decision over addresses, printed by `hetnode join` with a fix.

Other peers must open streams to us (they fetch our payloads; a chain's neighbours connect to us), so a peer
that only has private or loopback addresses while the swarm it joins is on the internet will be announced
but never fetched from. `judge` decides from dials made for real (`hetnode/net/dialback.py`): did the peer
we joined through open a fresh connection to our port, and did a stream reach us through a relay. `assess`
is the fallback when no dial-back could be made (a contact that does not answer it): it judges from our
own announced multiaddrs and where the peer we joined through lives, which inside one private network
(every address 10.x) cannot tell a NAT from a LAN.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

Verdict = Literal["reachable", "local-only", "unreachable"]


@dataclass(frozen=True)
class Reachability:
    verdict: Verdict
    relayed: bool
    reason: str
    fix: str  # empty when nothing needs doing
    dialled: bool = False  # decided by real dials, not from addresses

    @property
    def path(self) -> str:
        if self.relayed:
            return "relayed"
        return "direct" if self.dialled and self.verdict == "reachable" else ""

    def line(self) -> str:
        text = f"reachability: {self.verdict}{f' ({self.path})' if self.path else ''}: {self.reason}"
        return f"{text}. Fix: {self.fix}" if self.fix else text


def _scope(maddr: str) -> str | None:
    """ "loopback", "private" or "public" for an /ip4 or /ip6 multiaddr; None for anything else."""
    parts = maddr.split("/")
    if len(parts) < 3 or parts[1] not in ("ip4", "ip6"):
        return None
    try:
        ip = ipaddress.ip_address(parts[2])
    except ValueError:
        return None
    if ip.is_loopback:
        return "loopback"
    if ip.is_unspecified:
        return None
    return "private" if (ip.is_private or ip.is_link_local) else "public"


def _tcp_port(maddrs: Sequence[str]) -> int | None:
    for maddr in maddrs:
        parts = maddr.split("/")
        if "tcp" in parts and parts.index("tcp") + 1 < len(parts) and parts[parts.index("tcp") + 1].isdigit():
            return int(parts[parts.index("tcp") + 1])
    return None


def _forward_fix(port: int | None) -> str:
    if port:
        return (
            f"forward TCP port {port} on your router to this host and pass "
            f"--announce-maddr /ip4/<your public IP>/tcp/{port} (or listen on a fixed port with --listen)"
        )
    return (
        "listen on a fixed port (--listen /ip4/0.0.0.0/tcp/PORT), forward it on your router and pass "
        "--announce-maddr /ip4/<your public IP>/tcp/PORT"
    )


def judge(
    direct: bool | None, relayed: bool | None, own_maddrs: Sequence[str], contact_maddr: str, relay: str = ""
) -> Reachability:
    """The verdict from real dials: `direct` (the contact opened a fresh connection to our port; None:
    it could not tell, so judge from addresses) and `relayed` (a stranger's stream reached us through
    the relay `relay`; None: not tried)."""
    if direct is None:
        return assess(own_maddrs, contact_maddr)
    port = _tcp_port([m for m in own_maddrs if "/p2p-circuit" not in m])
    where = f"port {port}" if port else "this peer's port"
    if direct:
        return Reachability(
            "reachable", False, f"the peer we joined through opened a new connection to {where}", "", True
        )
    if relayed:
        return Reachability(
            "reachable",
            True,
            f"no new connection reaches {where} (NAT or firewall), but streams reach this peer through the "
            f"relay {relay[-8:] or 'it holds'} (slower: every byte crosses the relay)",
            _forward_fix(port),
            True,
        )
    return Reachability(
        "unreachable",
        False,
        f"no new connection reaches {where} (NAT or firewall) and no relay carries streams to this peer: "
        "peers cannot fetch its payloads",
        f"{_forward_fix(port)}; or join through a peer that serves relays (the coordinator does)",
        True,
    )


def assess(own_maddrs: Sequence[str], contact_maddr: str) -> Reachability:
    """Judge whether peers of the swarm reached through `contact_maddr` can dial one of `own_maddrs`."""
    relayed = any("/p2p-circuit" in m for m in own_maddrs)
    direct = [m for m in own_maddrs if "/p2p-circuit" not in m]
    scopes = {_scope(m) for m in direct} - {None}
    contact = _scope(contact_maddr)
    forward = _forward_fix(_tcp_port(direct))
    if "public" in scopes:
        return Reachability("reachable", relayed, "this peer announces a public address", "")
    if contact in ("loopback", "private") or contact is None:
        where = "this machine" if contact == "loopback" else "your network"
        if scopes and scopes <= {"loopback"} and contact != "loopback":
            return Reachability(
                "unreachable",
                relayed,
                "this peer announces only loopback addresses",
                f"listen on a LAN address; {forward}",
            )
        return Reachability("local-only", relayed, f"the swarm is on {where} and so is this peer", "")
    if relayed:
        return Reachability(
            "reachable",
            True,
            "no public address, but a relay carries streams to this peer (slower: every byte crosses it)",
            forward,
        )
    return Reachability(
        "unreachable",
        False,
        "the swarm is on the internet but this peer announces only private addresses: peers cannot fetch its "
        "payloads",
        forward,
    )
