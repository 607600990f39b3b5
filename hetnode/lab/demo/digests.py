"""The demo's proof that the swarm trained one model: every replica's published layer digests equal the
coordinator's record of the round that replica holds (equal digests, bit-identical θ; docs/sync.md)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any


def _by_peer(peers: Sequence[Mapping[str, Any]]) -> dict[str, Mapping[str, Any]]:
    return {p["peer_id"]: p for p in peers if isinstance(p, Mapping) and isinstance(p.get("peer_id"), str)}


def hold_round(peers: Sequence[Mapping[str, Any]], expected: Mapping[str, str], round_: int) -> bool:
    """Every expected replica (name -> peer id) publishes `round_` or a later one."""
    found = _by_peer(peers)
    for peer_id in expected.values():
        held = found.get(peer_id, {}).get("params_round")
        if not isinstance(held, int) or held < round_:
            return False
    return True


def compare_digests(
    peers: Sequence[Mapping[str, Any]], history: Sequence[Mapping[str, Any]], expected: Mapping[str, str]
) -> dict[str, Any]:
    """Each expected replica (`hetnode status --json` peers) against the history entry of its round.

    Returns `{"agree": bool, "rounds": [rounds held], "peers": [{name, params_round, agree, reason}]}`;
    `agree` is true only when every expected replica was found and matches."""
    by_round = {e.get("round"): e.get("layer_digests") for e in history if isinstance(e, Mapping)}
    found = _by_peer(peers)
    rows = []
    for name, peer_id in sorted(expected.items()):
        record = found.get(peer_id)
        held = record.get("params_round") if record else None
        reason = None
        if record is None:
            reason = "no record in the swarm"
        elif not isinstance(held, int):
            reason = "holds no round yet"
        elif by_round.get(held) is None:
            reason = f"round {held} is not in the coordinator's history"
        elif not _agrees(record.get("layer_digests"), by_round[held], record.get("role") == "anchor"):
            reason = f"digests differ from the coordinator's at round {held}"
        rows.append({"name": name, "params_round": held, "agree": reason is None, "reason": reason})
    rounds = sorted({r["params_round"] for r in rows if isinstance(r["params_round"], int)})
    return {"agree": bool(rows) and all(r["agree"] for r in rows), "rounds": rounds, "peers": rows}


def _agrees(held: Any, coordinator: Mapping[str, str], whole: bool) -> bool:
    """A replica's digests equal the coordinator's for the layers it holds (a chain stage holds only its
    own); an anchor must hold every layer."""
    if not isinstance(held, Mapping) or not held:
        return False
    if whole and set(held) != set(coordinator):
        return False
    return all(coordinator.get(shard) == digest for shard, digest in held.items())
