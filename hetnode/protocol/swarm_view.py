"""The swarm as one peer's DHT reads show it: validated peer records, claims, chains, the status document
(`SwarmView`). `view.py` keeps it current (`PeerDirectory`); `view_changes.py` moves it along the
coordinator's change log."""

from __future__ import annotations

import hashlib
import json
import logging
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from hetnode.config import Config
from hetnode.net.node import StoredValue, SwarmNode
from hetnode.net.records import check_peer_record
from hetnode.planning.roles import Candidate, ChainStatus, Claim, chain_prefix, chain_status, parse_layout

log = logging.getLogger(__name__)

ROLE_ORDER = {"coordinator": 0, "anchor": 1, "stage": 2, "idle": 3}


@dataclass(frozen=True)
class SwarmView:
    peers: dict[str, dict[str, Any]]  # peer id -> record (offline peers left out)
    stages_per_chain: int
    n_layers: int
    departed: set[str] = field(default_factory=set)  # peers whose record says they went offline
    stage_workers: int = 1  # the most workers a stage's pool may have (`pipeline.stage_workers`)

    @classmethod
    def from_entries(
        cls,
        entries: Mapping[str, StoredValue],
        stages_per_chain: int,
        n_layers: int,
        stage_workers: int = 1,
    ) -> SwarmView:
        view = cls({}, stages_per_chain, n_layers, stage_workers=stage_workers)
        for peer_id, entry in entries.items():
            record = view.admit(peer_id, entry.value)
            if record is not None:
                view.peers[peer_id] = record
            elif isinstance(entry.value, dict) and entry.value.get("role") == "offline":
                view.departed.add(peer_id)
        return view

    def admit(self, peer_id: str, value: Any) -> dict[str, Any] | None:
        """`value` as a record of this view (schema and model checked again), or None when it cannot be one
        or says the peer is offline."""
        try:
            record = check_peer_record(value)
        except Exception as exc:  # a relay passed on something our schema refuses
            log.debug("ignoring the record of peer %s: %s", peer_id, exc)
            return None
        shards = {"embed", "head", *(str(i) for i in range(self.n_layers))}
        problem = _model_problem(record, shards, self.n_layers)
        if problem:  # schema-valid, but not about this run's model: keys limited to its shards
            log.debug("ignoring the record of peer %s: %s", peer_id, problem)
            return None
        return record if record["role"] != "offline" else None

    @classmethod
    async def read(cls, node: SwarmNode, config: Config) -> SwarmView:
        """The current view through `node`: every fresh, valid peer record of the run."""
        p = config.pipeline
        return cls.from_entries(
            await node.read_field("peers"), p.stages, config.model.n_layers, p.stage_workers
        )

    def idle_candidates(self, boundary: int) -> list[Candidate]:
        """The pool at `boundary`: idle stage candidates, plus those that already claimed a chain formed at
        this boundary (peers read the pool at slightly different times; a quick claimer is still in it)."""
        prefix = chain_prefix(boundary)
        return [
            Candidate(peer_id, record["tflops"])
            for peer_id, record in self.peers.items()
            if record["wants"] == "stage"
            and (
                record["role"] == "idle"
                or (record["role"] == "stage" and (record["chain"] or "").startswith(prefix))
            )
        ]

    def claims(self) -> list[Claim]:
        return [
            Claim(
                peer_id,
                record["chain"],
                record["stage"],
                tuple(record["layers"]),
                parse_layout(record.get("chain_layout") or []),
                record.get("chain_lineage") or "",
                bool(record.get("chain_broken")),
                record.get("chain_blame") or "",
                tuple(record.get("chain_noshows") or ()),
            )
            for peer_id, record in self.peers.items()
            if record["role"] == "stage"
            and record["chain"]
            and record["stage"] is not None
            and record["layers"]
        ]

    def chains(self) -> list[ChainStatus]:
        return chain_status(self.claims(), self.stages_per_chain, self.n_layers, self.stage_workers)

    def chain_is_live(self, chain: str) -> bool:
        return any(c.chain == chain and c.live for c in self.chains())

    def expected_contributors(self, round_: int, overlap: bool = False) -> set[str]:
        """Whom a seal of `round_` waits for: every anchor, and every working member of a live chain that
        holds θ after round_−1 (a chain still forming or catching up is not waited for; it joins a later
        round; a pool's worker that left, says it broke or was caught lying is not waited for either).
        With `overlap` a member may still be applying round_−1 while it trains round_ (at most one round
        unapplied): θ after round_−2 will do."""
        working = {p for c in self.chains() if c.live for workers in c.workers for p in workers}
        oldest = round_ - (2 if overlap else 1)
        return {
            peer
            for peer, r in self.peers.items()
            if r["role"] == "anchor"
            or (r["role"] == "stage" and peer in working and _between(r["params_round"], oldest, round_ - 1))
        }

    def signature(self) -> frozenset:
        """Who is in the swarm in which role: what a change of makes the swarm unstable (not the
        per-round fields, which change every round)."""
        return frozenset(
            (peer, r["role"], r["wants"], r["chain"], r["stage"], tuple(r["layers"] or ()))
            for peer, r in self.peers.items()
        )

    def digest(self) -> str:
        """16 hex digits over what the swarm's decisions read from the records (who is in it, in which role
        and chain, with which links and compute), not the per-round fields: equal digests, equal decisions.
        The coordinator publishes its view's in its `head` entry (`PeerDirectory`)."""
        rows = sorted(self.row(peer) for peer in self.peers)
        text = json.dumps(rows, separators=(",", ":"), default=str)
        return hashlib.sha256(text.encode()).hexdigest()[:16]

    def row(self, peer: str) -> list[Any]:
        """What `digest` reads from one peer's record: a change of it is a change of the view."""
        r = self.peers[peer]
        return [
            peer,
            r["role"],
            r["wants"],
            r["chain"],
            r["stage"],
            r["layers"],
            r.get("chain_layout"),
            r.get("chain_lineage"),
            r.get("chain_broken"),
            r.get("chain_blame"),
            r.get("chain_noshows"),
            r["link_class"],
            r["tflops"],
        ]

    def status_document(self, run: str, round_: int) -> dict[str, Any]:
        """The stable `hetnode status --json` document (later versions add fields, never rename)."""
        peers = [
            {
                "peer_id": peer_id,
                "name": r["name"],
                "class": r["link_class"],
                "role": r["role"],
                "chain": r["chain"],
                "stage": r["stage"],
                "layers": r["layers"],
                "up_mbps": r["up_mbps"],
                "down_mbps": r["down_mbps"],
                "rtt_ms": r["rtt_ms"],
                "tflops": r["tflops"],
                "last_seen": r["last_seen"],
                "params_round": r["params_round"],
                "layer_digests": r["layer_digests"],
                "tokens": r["tokens"],
                "utilization": r.get("utilization"),
            }
            for peer_id, r in self.peers.items()
        ]
        peers.sort(
            key=lambda p: (
                ROLE_ORDER.get(p["role"], 9),
                p["chain"] or "",
                p["stage"] or 0,
                p["name"],
                p["peer_id"],
            )
        )
        chains = [
            {
                "id": c.chain,
                "live": c.live,
                "stages": list(c.stages),
                "problem": c.problem,
                "lineage": c.lineage,
                "blamed": list(c.blamed),
                "workers": [list(w) for w in c.workers],
                "dropped": c.dropped,
            }
            for c in self.chains()
        ]
        # "round" kept as it was named first; "boundary_round" says what it counts (not a sync round)
        return {"run": run, "round": round_, "boundary_round": round_, "peers": peers, "chains": chains}


def _model_problem(record: dict[str, Any], shards: set[str], n_layers: int) -> str:
    """Why a schema-valid record cannot be about this run's model ("" when it can)."""
    digests = record.get("layer_digests") or {}
    if not set(digests) <= shards:
        return f"layer_digests name shards the model does not have: {sorted(set(digests) - shards)[:3]}"
    layers = record.get("layers")
    if layers is not None and not 0 <= layers[0] <= layers[1] < n_layers:
        return f"layers {layers} outside 0..{n_layers - 1}"
    if len(record.get("chain_layout") or ()) > 64:
        return "a chain layout longer than any chain"
    return ""


def _between(value: object, low: int, high: int) -> bool:
    return isinstance(value, int) and low <= value <= high
