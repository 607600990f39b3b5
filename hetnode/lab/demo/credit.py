"""The demo's contributions table: each peer's credit over a stretch of sealed rounds, from the coordinator's
round history (`hetnode/wire/round_history.py`), so that the report can count exactly the rounds it shows.

Each seal line keeps the ledger's row for every contributor (`credits`: credited `tokens` and
`replica_tokens`, by the one rule of docs/observability.md, "Contribution credit"); the round's evaluated
line names the contributions whose credit the verifier refused (`rejected`). The ledger writes exactly the
rows less the refused ones, so over the same rounds these standings are the ledger's
(`tests/swarm/test_demo.py` compares them with `ledger.sqlite`).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from hetnode.lab.demo.rounds import number


def credited_rows(entry: Mapping[str, Any]) -> dict[str, Mapping[str, Any]]:
    """The ledger's rows of one history entry: its `credits` less the contributions refused credit."""
    credits = entry.get("credits")
    rejected = entry.get("rejected")
    refused = set(rejected) if isinstance(rejected, Mapping) else set()
    if not isinstance(credits, Mapping):
        return {}
    return {
        str(peer): row for peer, row in credits.items() if isinstance(row, Mapping) and peer not in refused
    }


def _count(value: Any) -> int:
    x = number(value)
    return int(x) if x is not None and x > 0 else 0


def credit_standings(
    entries: Iterable[Mapping[str, Any]], names: Mapping[str, str] | None = None
) -> list[dict[str, Any]]:
    """Per peer over `entries`: `tokens` credited, `replica_tokens` (what its replica trained: a stage's
    chain's), `of_replica` (the first over the second), `share` (of all tokens credited in `entries`) and
    `rounds`; most credited first. `names`: peer id -> the demo's process name."""
    names = names or {}
    peers: dict[str, dict[str, Any]] = {}
    for entry in entries:
        for peer, row in credited_rows(entry).items():
            tokens = _count(row.get("tokens"))
            replica = _count(row.get("replica_tokens", row.get("tokens")))
            name = names.get(peer) or str(row.get("name") or peer[-8:])
            standing = peers.setdefault(
                peer, {"name": name, "peer": peer, "role": row.get("role"), "tokens": 0, "replica_tokens": 0}
            )
            standing["tokens"] += tokens
            standing["replica_tokens"] += replica
            standing["rounds"] = standing.get("rounds", 0) + 1
            standing["bytes_sent"] = standing.get("bytes_sent", 0) + _count(row.get("bytes"))
    total = sum(s["tokens"] for s in peers.values())
    for s in peers.values():
        s["share"] = s["tokens"] / total if total else 0.0
        s["of_replica"] = s["tokens"] / s["replica_tokens"] if s["replica_tokens"] else None
    return sorted(peers.values(), key=lambda s: (-s["tokens"], str(s["name"]), s["peer"]))
