"""A P2P listen port already taken is refused before p2pd starts (p2pd itself would share it)."""

from __future__ import annotations

import asyncio
import socket

import pytest

from hetnode.errors import HetnodeError
from hetnode.net import listen_ports
from hetnode.net.listen_ports import refuse_taken_ports, tcp_binds


def test_only_fixed_tcp_ports_are_checked():
    assert tcp_binds(
        [
            "/ip4/0.0.0.0/tcp/31337",
            "/ip6/::1/tcp/4001/p2p/QmYyQSo1c1Ym7orWxLYvCrM2EmxFTANf8wXmmE7DWjhx5N",
            "/ip4/127.0.0.1/tcp/0",  # any free port
            "/ip4/127.0.0.1/udp/4001/quic",
            "/dns4/example.org/tcp/4001",
            "/ip4/1.2.3.4/tcp/99999",
        ]
    ) == [(socket.AF_INET, "0.0.0.0", 31337), (socket.AF_INET6, "::1", 4001)]


def held_like_p2pd() -> socket.socket:
    """A listener as p2pd opens it: SO_REUSEPORT, so a second p2pd could bind the same port."""
    holder = socket.socket()
    holder.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    holder.bind(("127.0.0.1", 0))
    holder.listen(1)
    return holder


def test_a_port_in_use_is_refused_naming_the_flag_and_the_fix(monkeypatch):
    monkeypatch.setattr(listen_ports, "RELEASE_WAIT_S", 0.3)
    with held_like_p2pd() as holder:
        port = holder.getsockname()[1]
        with pytest.raises(HetnodeError, match=f"port {port} is in use") as error:
            asyncio.run(refuse_taken_ports([f"/ip4/127.0.0.1/tcp/{port}"]))
    assert "--listen" in str(error.value) and "/tcp/0" in str(error.value)


def test_a_free_port_and_a_port_released_in_time_pass():
    with held_like_p2pd() as holder:
        port = holder.getsockname()[1]
    asyncio.run(refuse_taken_ports([f"/ip4/127.0.0.1/tcp/{port}", "/ip4/127.0.0.1/tcp/0"]))

    async def released_after(seconds: float) -> None:
        holder = held_like_p2pd()
        asyncio.get_running_loop().call_later(seconds, holder.close)  # a stopped daemon's p2pd exiting
        await refuse_taken_ports([f"/ip4/127.0.0.1/tcp/{holder.getsockname()[1]}"])

    asyncio.run(released_after(0.4))
