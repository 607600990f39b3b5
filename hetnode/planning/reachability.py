"""Can the swarm dial this peer back? A decision over addresses, printed by `hetnode join` with a fix.

Other peers must open streams to us (they fetch our payloads; a chain's neighbours connect to us), so a peer
that only has private or loopback addresses while the swarm it joins is on the internet will be announced
but never fetched from. We judge from what we can see without help: our own announced multiaddrs, whether
any goes through a relay (`/p2p-circuit`), and where the peer we joined through lives.
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

    def line(self) -> str:
        text = f"reachability: {self.verdict}{' (relayed)' if self.relayed else ''}: {self.reason}"
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


def assess(own_maddrs: Sequence[str], contact_maddr: str) -> Reachability:
    """Judge whether peers of the swarm reached through `contact_maddr` can dial one of `own_maddrs`."""
    relayed = any("/p2p-circuit" in m for m in own_maddrs)
    direct = [m for m in own_maddrs if "/p2p-circuit" not in m]
    scopes = {_scope(m) for m in direct} - {None}
    contact = _scope(contact_maddr)
    port = _tcp_port(direct)
    forward = (
        f"forward TCP port {port} on your router to this host and pass "
        f"--announce-maddr /ip4/<your public IP>/tcp/{port} (or listen on a fixed port with --listen)"
        if port
        else "listen on a fixed port (--listen /ip4/0.0.0.0/tcp/PORT), forward it on your router and pass "
        "--announce-maddr /ip4/<your public IP>/tcp/PORT"
    )
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
