"""`hetnode status`: a short-lived DHT client that reads the swarm through any known peer."""

from __future__ import annotations

import asyncio
import math
import re
import time
import unicodedata
from typing import Any

from hetnode.daemon.membership import Membership
from hetnode.daemon.swarm import find_run, read_round
from hetnode.daemon.view import SwarmView
from hetnode.errors import HetnodeError
from hetnode.net.identity import ephemeral_identity, peer_id_from_maddr
from hetnode.net.node import DEFAULT_LIMITS, PeersUnreachable, SwarmNode
from hetnode.service.lifecycle import unless_stopped


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


# Terminal escape sequences: CSI (ESC [ or U+009B ... final byte); OSC, DCS, SOS, PM, APC strings up to BEL
# or ST (or the end); any other ESC with its intermediates and final byte. A cut-off one is removed too.
_ESCAPES = re.compile(
    r"(?:\x1b\[|\x9b)[0-?]*[ -/]*[@-~]?"
    r"|(?:\x1b[\]PX^_]|[\x90\x98\x9d\x9e\x9f])[^\x07\x1b\x9c]*(?:\x07|\x1b\\|\x9c)?"
    r"|\x1b[ -/]*[0-~]?"
)
_JOINERS = {"\u200c", "\u200d"}  # ZWNJ, ZWJ: needed by emoji sequences and several scripts, inert


def _printable_char(char: str) -> str:
    category = unicodedata.category(char)
    if category in ("Zl", "Zp") or (category == "Cc" and char in "\t\n\v\f\r\x85"):
        return " "
    if category == "Cc" or (category == "Cf" and char not in _JOINERS):
        return ""  # other C0/C1 controls, DEL, bidi overrides and isolates, invisible tags
    if category == "Cs":
        return "\ufffd"
    return char


def printable(text: str, limit: int) -> str:
    """`text` safe to print on a terminal, at most `limit` characters (an ellipsis marks a cut).

    Peer-chosen strings (names, roles, chain ids: anything read from the DHT) could otherwise move the
    cursor, retitle the window, hide or reorder text (bidi overrides) or plant clickable links (OSC 8).
    Escape sequences are removed whole, other control and format characters dropped (line breaks and tabs
    become spaces); letters, marks, symbols and emoji of any script are kept.
    """
    if limit <= 0:
        return ""
    if not isinstance(text, str):
        text = str(text)
    # Cutting first bounds the work; a sequence cut in half is still removed whole (see _ESCAPES).
    text = text[: 16 * limit + 1024]
    clean = "".join(_printable_char(char) for char in _ESCAPES.sub("", text))
    return clean if len(clean) <= limit else clean[: limit - 1] + "\u2026"


def _cell(value: Any, limit: int) -> str:
    return "-" if value is None or value == "" else printable(str(value), limit) or "-"


def format_mbit(value: Any) -> str:
    """A link rate in Mbit/s as people write it: "1000", "12.5", "0.25" (never "1e+03"); "-" if unknown."""
    if not isinstance(value, int | float) or isinstance(value, bool) or not math.isfinite(value) or value < 0:
        return "-"
    if value >= 100:
        return f"{value:.0f}"
    if value >= 10 or value == 0:
        return f"{value:.1f}".removesuffix(".0")
    if value >= 0.01:
        return f"{value:.2f}".rstrip("0").rstrip(".")
    return "<0.01"


def format_share(value: Any) -> str:
    """A share in [0, 1] as a whole percentage ("93%"); "-" when unknown or not a share."""
    if not isinstance(value, int | float) or isinstance(value, bool) or not 0 <= value <= 1:
        return "-"
    return f"{100 * value:.0f}%"


def render_table(document: dict[str, Any]) -> str:
    """The swarm as a table; every string from the DHT goes through `printable` first."""
    now = document.get("time", time.time())
    peers, chains = document.get("peers") or [], document.get("chains") or []
    lines = [
        f"run {_cell(document.get('run'), 64)} ({_cell(document.get('config'), 64)}), "
        f"boundary {_cell(document.get('round'), 20)}, {len(peers)} peers, "
        f"coordinator {_cell(str(document.get('coordinator', ''))[-8:], 8)}",
        "",
        f"{'name':<16} {'peer':<10} {'class':<6} {'role':<12} {'chain':<16} {'stage':>5} {'layers':>7} "
        f"{'up Mb/s':>8} {'down Mb/s':>9} {'holds':>5} {'util':>5} {'embed digest':<16} {'seen':>6}",
    ]
    for p in peers:
        layers = p.get("layers")
        span = (
            f"{_cell(layers[0], 3)}-{_cell(layers[1], 3)}"
            if isinstance(layers, list | tuple) and len(layers) == 2
            else "-"
        )
        digests = p.get("layer_digests")
        digest = digests.get("embed") if isinstance(digests, dict) else None
        last_seen = p.get("last_seen")
        seen = f"{now - last_seen:.0f}s" if isinstance(last_seen, int | float) else "-"
        lines.append(
            f"{_cell(p.get('name'), 16):<16} {_cell(str(p.get('peer_id', ''))[-8:], 8):<10} "
            f"{_cell(p.get('class'), 6):<6} {_cell(p.get('role'), 12):<12} {_cell(p.get('chain'), 32):<16} "
            f"{_cell(p.get('stage'), 5):>5} {span:>7} {format_mbit(p.get('up_mbps')):>8} "
            f"{format_mbit(p.get('down_mbps')):>9} {_cell(p.get('params_round'), 5):>5} "
            f"{format_share(p.get('utilization')):>5} {_cell(digest, 16):<16} {seen:>6}"
        )
    lines.append("")
    if not chains:
        lines.append("no chains")
    for chain in chains:
        members = ", ".join(_cell(str(peer or "?")[-8:], 8) for peer in chain.get("stages") or [])
        state = "live" if chain.get("live") else f"not live ({_cell(chain.get('problem'), 80)})"
        lines.append(f"chain {_cell(chain.get('id'), 64)}: {state}; stages {members}")
    return "\n".join(lines)
