"""The coordinator's swarm-level series (docs/observability.md), added to its own peer registry: peers by role
and class, live chains, sealed rounds, global eval loss, the bytes of each sealed round, how far the
bookkeeping worker beside the seal is behind (`bootstrap/bookkeeping.py`), and the contribution ledger
(per-peer labels live only here)."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from prometheus_client import Counter, Gauge

from bootstrap.ledger import Ledger, LedgerCollector
from hetnode.service.metrics import PeerMetrics

ROLES = ("anchor", "stage", "idle")
CLASSES = ("high", "low", "slow")
REPLICA_ROLES = ("anchor", "stage")


class SwarmMetrics:
    def __init__(self, peer_metrics: PeerMetrics, ledger: Ledger) -> None:
        # the coordinator's own hetnode_sync_round_seconds times its seals (it never announces a payload)
        self.round_seconds = peer_metrics.round_seconds
        r = peer_metrics.registry
        self.peers = Gauge(
            "hetnode_swarm_peers", "Live peers by role and link class", ["role", "class"], registry=r
        )
        self.chains = Gauge("hetnode_swarm_chains", "Live chains (complete virtual replicas)", registry=r)
        self.rounds_sealed = Counter(
            "hetnode_rounds_sealed", "Sync rounds sealed by this coordinator", registry=r
        )
        self.eval_loss = Gauge(
            "hetnode_global_eval_loss", "Eval loss of the global θ after the last round", registry=r
        )
        self.contributors = Gauge(
            "hetnode_round_contributors", "Contributions in the last sealed round", registry=r
        )
        self.payload_bytes = Gauge(
            "hetnode_round_payload_bytes",
            "Sealed payload bytes in the last round by replica class",
            ["role"],
            registry=r,
        )
        self.dense_bytes = Gauge(
            "hetnode_round_dense_bytes",
            "The last round's contributions as dense fp32 pseudo-gradients",
            registry=r,
        )
        self.bookkeeping_lag = Gauge(
            "hetnode_bookkeeping_lag_rounds",
            "Sealed rounds the bookkeeping worker (scores, credit, evaluation, checkpoints) has not finished",
            registry=r,
        )
        self.bookkeeping_skipped = Counter(
            "hetnode_bookkeeping_skipped_rounds",
            "Sealed rounds whose scoring and evaluation the worker skipped, behind or stopping",
            registry=r,
        )
        for role in ROLES:  # every combination exists, zeros included, so a panel never goes blank
            for link_class in CLASSES:
                self.peers.labels(role=role, **{"class": link_class}).set(0)
        for role in REPLICA_ROLES:
            self.payload_bytes.labels(role=role).set(0)
        self.chains.set(0)
        self.contributors.set(0)
        self.dense_bytes.set(0)
        self.bookkeeping_lag.set(0)
        r.register(LedgerCollector(ledger))

    def observe_view(self, peers: Mapping[str, Mapping[str, Any]], live_chains: int) -> None:
        counts = {(role, c): 0 for role in ROLES for c in CLASSES}
        for record in peers.values():
            key = (record.get("role"), record.get("link_class"))
            if key in counts:
                counts[key] += 1
        for (role, link_class), n in counts.items():
            self.peers.labels(role=role, **{"class": link_class}).set(n)
        self.chains.set(live_chains)

    def observe_seal(
        self, payload_bytes: Mapping[str, int], dense_bytes: int, contributors: int, seconds: float
    ) -> None:
        self.rounds_sealed.inc()
        self.contributors.set(contributors)
        for role in REPLICA_ROLES:
            self.payload_bytes.labels(role=role).set(payload_bytes.get(role, 0))
        self.dense_bytes.set(dense_bytes)
        self.round_seconds.observe(seconds)

    def observe_eval(self, eval_loss: float) -> None:
        """From the bookkeeping worker's thread (prometheus_client is thread-safe)."""
        if math.isfinite(eval_loss):
            self.eval_loss.set(eval_loss)
