"""`hetnode status` as a table: every string a peer chose made safe for a terminal, link rates and shares
as people write them, and each peer's θ held against the coordinator's, shard by shard.

Light on purpose (the standard library and `service/formatting.py` only): the table is printed from the
coordinator's `/api/swarm` without loading hivemind or torch."""

from __future__ import annotations

import re
import time
import unicodedata
from typing import Any

from hetnode.service.formatting import format_mbit

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


def format_share(value: Any) -> str:
    """A share in [0, 1] as a whole percentage ("93%"); "-" when unknown or not a share."""
    if not isinstance(value, int | float) or isinstance(value, bool) or not 0 <= value <= 1:
        return "-"
    return f"{100 * value:.0f}%"


DIGEST_LEGEND = (
    "digests: the shards a peer holds against the coordinator's θ (agree n/n: all equal; DIFFER k/n: k of n "
    "differ; other round: not comparable)"
)


def digest_agreement(peer: dict[str, Any], reference: dict[str, Any] | None) -> str:
    """How `peer`'s layer digests compare with the coordinator's (`reference`, its own entry), over the
    shards both report: "agree 3/3", "DIFFER 1/3" (1 of 3 differs), "other round" when they hold different
    rounds (digests of different θ say nothing), "reference" for the coordinator, "-" when nothing to compare.
    """
    if reference is None:
        return "-"
    if peer is reference:
        return "reference"
    mine, theirs = peer.get("layer_digests"), reference.get("layer_digests")
    if not isinstance(mine, dict) or not isinstance(theirs, dict):
        return "-"
    shards = [shard for shard in mine if shard in theirs]
    if not shards:
        return "-"
    if peer.get("params_round") != reference.get("params_round"):
        return "other round"
    differ = sum(1 for shard in shards if mine[shard] != theirs[shard])
    return f"DIFFER {differ}/{len(shards)}" if differ else f"agree {len(shards)}/{len(shards)}"


def _coordinator_entry(document: dict[str, Any], peers: list[Any]) -> dict[str, Any] | None:
    """The coordinator's own entry, found by its peer id (a role is only what a peer says of itself)."""
    coordinator = document.get("coordinator")
    return next((p for p in peers if isinstance(p, dict) and p.get("peer_id") == coordinator), None)


def render_table(document: dict[str, Any]) -> str:
    """The swarm as a table; every string from the DHT goes through `printable` first."""
    now = document.get("time", time.time())
    peers, chains = document.get("peers") or [], document.get("chains") or []
    reference = _coordinator_entry(document, peers)
    sealed = f" (holds round {_cell(reference.get('params_round'), 12)})" if reference else ""
    lines = [
        f"run {_cell(document.get('run'), 64)} ({_cell(document.get('config'), 64)}), "
        f"boundary {_cell(document.get('round'), 20)}, {len(peers)} peers, "
        f"coordinator {_cell(str(document.get('coordinator', ''))[-8:], 8)}{sealed}",
        "",
        f"{'name':<16} {'peer':<10} {'class':<6} {'role':<12} {'chain':<16} {'stage':>5} {'layers':>7} "
        f"{'up Mb/s':>8} {'down Mb/s':>9} {'holds round':>11} {'util':>5} {'digests':<11} {'seen':>6}",
    ]
    compared = False
    for p in peers:
        layers = p.get("layers")
        span = (
            f"{_cell(layers[0], 3)}-{_cell(layers[1], 3)}"
            if isinstance(layers, list | tuple) and len(layers) == 2
            else "-"
        )
        digests = digest_agreement(p, reference)
        compared = compared or digests.startswith(("agree", "DIFFER"))
        last_seen = p.get("last_seen")
        seen = f"{now - last_seen:.0f}s" if isinstance(last_seen, int | float) else "-"
        lines.append(
            f"{_cell(p.get('name'), 16):<16} {_cell(str(p.get('peer_id', ''))[-8:], 8):<10} "
            f"{_cell(p.get('class'), 6):<6} {_cell(p.get('role'), 12):<12} {_cell(p.get('chain'), 32):<16} "
            f"{_cell(p.get('stage'), 5):>5} {span:>7} {format_mbit(p.get('up_mbps')):>8} "
            f"{format_mbit(p.get('down_mbps')):>9} {_cell(p.get('params_round'), 11):>11} "
            f"{format_share(p.get('utilization')):>5} {digests:<11} {seen:>6}"
        )
    if compared:
        lines.append(DIGEST_LEGEND)
    lines.append("")
    if not chains:
        lines.append("no chains")
    for chain in chains:
        pools = chain.get("workers") or [[peer] for peer in chain.get("stages") or []]
        members = " | ".join(
            ", ".join(
                _cell(str(peer or "?")[-8:], 8) for peer in (pool if isinstance(pool, list) else [pool])
            )
            or "-"
            for pool in pools
        )
        state = "live" if chain.get("live") else f"not live ({_cell(chain.get('problem'), 80)})"
        lineage = chain.get("lineage")
        since = f" (goes on from {_cell(lineage, 64)})" if lineage and lineage != chain.get("id") else ""
        blamed = ", ".join(_cell(str(p)[-8:], 8) for p in chain.get("blamed") or [])
        caught = f"; caught lying: {blamed}" if blamed else ""
        dropped = chain.get("dropped")
        left = [
            f"{_cell(str(p)[-8:], 8)} ({_cell(why, 40)})"
            for p, why in (dropped.items() if isinstance(dropped, dict) else ())
            if why != "caught lying"
        ]
        gone = f"; dropped: {', '.join(left)}" if left else ""
        lines.append(f"chain {_cell(chain.get('id'), 64)}{since}: {state}; stages {members}{caught}{gone}")
    return "\n".join(lines)
