"""`hetnode status --peer MULTIADDR`: a short-lived DHT client that reads the swarm through any known peer
(`--peer http://…` reads the coordinator's `/api/swarm` instead: `status_http.py`)."""

from __future__ import annotations

import asyncio
import time
from typing import Any

from hetnode.daemon.status_table import format_share, printable, render_table
from hetnode.daemon.swarm import find_run, read_round, refuse_another_peer
from hetnode.errors import HetnodeError
from hetnode.net.identity import ephemeral_identity
from hetnode.net.node import DEFAULT_LIMITS, PeersUnreachable, SwarmNode
from hetnode.net.peer_ids import peer_id_from_maddr
from hetnode.protocol.membership import Membership
from hetnode.protocol.swarm_view import SwarmView
from hetnode.service.lifecycle import unless_stopped

# the table's helpers are importable from here too, as before they had a module of their own
__all__ = ["format_share", "printable", "query_status", "render_table"]


async def query_status(
    peer_maddr: str, timeout_s: float, listen: str, stop: asyncio.Event | None = None
) -> dict[str, Any]:
    """The swarm's status document, read within about `timeout_s`; `Stopped` as soon as `stop` is set."""
    peer_id_from_maddr(peer_maddr)  # a clear error before any daemon starts
    stop = stop or asyncio.Event()
    deadline = time.monotonic() + timeout_s
    starting = SwarmNode.start(
        ephemeral_identity(), DEFAULT_LIMITS, [listen], initial_peers=[peer_maddr], client_mode=True
    )
    try:
        node = await unless_stopped(stop, asyncio.wait_for(starting, timeout_s), f"reaching {peer_maddr}")
    except TimeoutError:
        raise HetnodeError(f"cannot reach {peer_maddr} within {timeout_s:g} s (--timeout)") from None
    except PeersUnreachable as exc:
        await refuse_another_peer(peer_maddr, stop)  # a live peer with another id: say so, not "unreachable"
        raise HetnodeError(
            f"cannot reach {peer_maddr}: {exc} (is it running? a multiaddr from its READY line, "
            "or the coordinator's http://HOST:8400)"
        ) from None
    try:
        left = max(1.0, deadline - time.monotonic())
        return await unless_stopped(
            stop, asyncio.wait_for(_read_status(node, peer_maddr, left, stop), left), "reading the swarm"
        )
    except TimeoutError:
        raise HetnodeError(
            f"{peer_maddr} answered, but the swarm was not read within {timeout_s:g} s (--timeout)"
        ) from None
    finally:
        await node.shutdown()


async def _read_status(
    node: SwarmNode, peer_maddr: str, timeout_s: float, stop: asyncio.Event
) -> dict[str, Any]:
    contact = await find_run(node, peer_maddr, timeout_s, stop, client_mode=True)
    config = contact.manifest.config
    membership = Membership(node, config, contact.manifest, contact.coordinator)
    if membership.closed:  # a closed run shows its admitted members only
        await membership.refresh()
        node.set_member_policy(membership.is_member)
    view = await SwarmView.read(node, config)
    round_ = await read_round(node, contact.coordinator)
    document = view.status_document(contact.manifest.run, round_ if round_ is not None else -1)
    document["coordinator"] = contact.coordinator
    document["config"] = config.run.name
    document["time"] = time.time()
    return document
