"""`hetnode status`: a short-lived DHT client that reads the swarm through any known peer."""

from __future__ import annotations

import asyncio
import time
from typing import Any

from hetnode.daemon.swarm import find_run, read_round
from hetnode.daemon.view import SwarmView
from hetnode.net.identity import ephemeral_identity, peer_id_from_maddr
from hetnode.net.node import DEFAULT_LIMITS, SwarmNode


async def query_status(peer_maddr: str, timeout_s: float, listen: str) -> dict[str, Any]:
    peer_id_from_maddr(peer_maddr)  # a clear error before any daemon starts
    node = await SwarmNode.start(
        ephemeral_identity(), DEFAULT_LIMITS, [listen], initial_peers=[peer_maddr], client_mode=True
    )
    try:
        contact = await find_run(node, peer_maddr, timeout_s, asyncio.Event(), client_mode=True)
        config = contact.manifest.config
        view = await SwarmView.read(node, config)
        round_ = await read_round(node, contact.coordinator)
        document = view.status_document(contact.manifest.run, round_ if round_ is not None else -1)
        document["coordinator"] = contact.coordinator
        document["config"] = config.run.name
        document["time"] = time.time()
        return document
    finally:
        await node.shutdown()


def render_table(document: dict[str, Any]) -> str:
    now = document.get("time", time.time())
    lines = [
        f"run {document['run']} ({document['config']}), round {document['round']}, "
        f"{len(document['peers'])} peers, coordinator {document['coordinator'][-8:]}",
        "",
        f"{'name':<16} {'peer':<10} {'class':<6} {'role':<12} {'chain':<16} {'stage':>5} {'layers':>7} "
        f"{'up Mb/s':>8} {'down Mb/s':>9} {'round':>5} {'embed digest':<16} {'seen':>6}",
    ]
    for p in document["peers"]:
        layers = f"{p['layers'][0]}-{p['layers'][1]}" if p["layers"] else "-"
        up = f"{p['up_mbps']:.1f}" if p["up_mbps"] is not None else "-"
        down = f"{p['down_mbps']:.1f}" if p["down_mbps"] is not None else "-"
        stage = "-" if p["stage"] is None else str(p["stage"])
        chain = p["chain"] or "-"
        seen = f"{now - p['last_seen']:.0f}s"
        applied = "-" if p.get("params_round") is None else str(p["params_round"])
        digest = (p.get("layer_digests") or {}).get("embed", "-")
        lines.append(
            f"{p['name'][:16]:<16} {p['peer_id'][-8:]:<10} {p['class']:<6} {p['role']:<12} {chain:<16} "
            f"{stage:>5} {layers:>7} {up:>8} {down:>9} {applied:>5} {digest:<16} {seen:>6}"
        )
    lines.append("")
    if not document["chains"]:
        lines.append("no chains")
    for chain in document["chains"]:
        members = ", ".join((peer or "?")[-8:] for peer in chain["stages"])
        state = "live" if chain["live"] else f"not live ({chain['problem']})"
        lines.append(f"chain {chain['id']}: {state}; stages {members}")
    return "\n".join(lines)
