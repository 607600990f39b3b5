"""Refusing a P2P listen port that is already taken, before p2pd starts.

p2pd listens with SO_REUSEPORT (libp2p dials out from its listen port), so a second p2pd on a port another
one holds starts fine: two coordinators would share the port, each getting half of the connections. A
plain bind without SO_REUSEPORT is refused while any socket listens there; with SO_REUSEADDR it is not
refused by the TIME_WAIT connections a daemon that just stopped leaves behind (a restart on its port).
"""

from __future__ import annotations

import asyncio
import errno
import socket
from collections.abc import Sequence

from hetnode.errors import HetnodeError

RELEASE_WAIT_S = 2.0  # a p2pd whose daemon was just killed lets go of its port within this
POLL_S = 0.25


def tcp_binds(maddrs: Sequence[str]) -> list[tuple[socket.AddressFamily, str, int]]:
    """(family, host, port) for each `/ip4|ip6/HOST/tcp/PORT` multiaddr with a fixed port (0: any port)."""
    binds = []
    for maddr in maddrs:
        parts = maddr.strip("/").split("/")
        if len(parts) >= 4 and parts[0] in ("ip4", "ip6") and parts[2] == "tcp" and parts[3].isdigit():
            port = int(parts[3])
            if 0 < port < 65536:
                family = socket.AF_INET if parts[0] == "ip4" else socket.AF_INET6
                binds.append((family, parts[1], port))
    return binds


def bind_problem(family: socket.AddressFamily, host: str, port: int) -> OSError | None:
    """Why a listener could not bind host:port now (None: it could)."""
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind((host, port))
        except OSError as exc:
            return exc
    return None


async def refuse_taken_ports(maddrs: Sequence[str], flag: str = "--listen") -> None:
    """Raise, naming `flag` and the fix, if a fixed port among `maddrs` cannot be bound; a port in use is
    looked at again for RELEASE_WAIT_S first."""
    for family, host, port in tcp_binds(maddrs):
        loop = asyncio.get_running_loop()
        deadline = loop.time() + RELEASE_WAIT_S
        problem = bind_problem(family, host, port)
        while problem is not None and problem.errno == errno.EADDRINUSE and loop.time() < deadline:
            await asyncio.sleep(POLL_S)
            problem = bind_problem(family, host, port)
        if problem is None:
            continue
        if problem.errno == errno.EADDRINUSE:
            why = f"port {port} is in use (another hetnode coordinator or peer, or another program, holds it)"
        else:
            why = problem.strerror or str(problem)
        raise HetnodeError(
            f"cannot listen on {host}:{port}: {why}; pick another port with {flag}, "
            f"e.g. /ip4/0.0.0.0/tcp/0 for any free one"
        )
