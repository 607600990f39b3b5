"""Prometheus series of one daemon (docs/observability.md). Names are `hetnode_*` with unit suffixes.

Each daemon owns its registry (no process-global state, so tests can run several in one process). Peers
export only their own series with bounded labels; per-peer labels (`peer`, `name`) appear only in the
coordinator's series (`bootstrap/swarm_metrics.py`).

The training loops feed `PeerMetrics` once per round from the same `RoundRecord` that goes to
`rounds-local.jsonl` (activation bytes among it); the bytes of sync payloads, state transfer and probes
are counted by the node as they flow and read at scrape time.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Mapping
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from hetnode.service.round_log import RoundRecord

CHANNELS = ("sync", "activations", "state", "probe")
ROUND_SECONDS_BUCKETS = (0.1, 0.25, 0.5, 1, 2, 5, 10, 20, 30, 60, 120, 300)


class PeerMetrics:
    """What one participant trained and sent. Thread-safe: the HTTP thread scrapes while the loop updates."""

    def __init__(
        self,
        record: Callable[[], Mapping[str, Any]] = dict,
        traffic: Callable[[], Mapping[tuple[str, str], int]] = dict,
        trains: bool = True,
    ) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        # the coordinator shares these series but trains nothing: it leaves the training ones out
        self.trains = trains
        training = r if trains else None
        self.tokens = Counter(
            "hetnode_tokens_processed", "Tokens trained through this peer", registry=training
        )
        self.inner_steps = Counter("hetnode_inner_steps", "Inner optimiser steps taken", registry=training)
        self.train_loss = Gauge(
            "hetnode_train_loss", "Training loss at the end of the last round", registry=training
        )
        self.tokens_per_second = Gauge(
            "hetnode_train_tokens_per_second",
            "Tokens per second in the last round's training",
            registry=training,
        )
        self.round_seconds = Histogram(
            "hetnode_sync_round_seconds",
            "From announcing a payload to having applied the round (coordinator: from seal to applied)",
            buckets=ROUND_SECONDS_BUCKETS,
            registry=r,
        )
        self.rounds_left_out = Counter(
            "hetnode_sync_rounds_left_out", "Rounds sealed without our payload", registry=training
        )
        self.rounds_sat_out = Counter(
            "hetnode_sync_rounds_sat_out",
            "Paced rounds we took no part in: even our floor of inner steps did not fit the round's budget",
            registry=training,
        )
        self.digest_mismatches = Counter(
            "hetnode_digest_mismatch",
            "Rounds after which our layer digests differed from the coordinator's (θ was downloaded again)",
            registry=training,
        )
        self.compression = Gauge(
            "hetnode_compression_ratio",
            "Dense bytes over sent bytes (sparseloco: fp32 pseudo-gradient; subspace: bf16 activations)",
            ["kind"],
            registry=r,
        )
        self._round_bytes: dict[tuple[str, str], int] = {}
        r.register(_NodeCollector(record, traffic, self._round_bytes))

    def add_round(self, record: RoundRecord) -> None:
        """One finished round of ours (`take_part` calls this after it appended the round log)."""
        self.tokens.inc(record.tokens)
        self.inner_steps.inc(record.steps)
        if record.loss is not None and math.isfinite(record.loss):
            self.train_loss.set(record.loss)
        self.tokens_per_second.set(record.tokens_per_s)
        self.round_seconds.observe(record.seal_wait_s + record.apply_s)
        if not record.included:
            self.rounds_left_out.inc()
        for key, n in (
            (("sent", "activations"), record.activation_bytes_sent),
            (("received", "activations"), record.activation_bytes_received),
        ):
            self._round_bytes[key] = self._round_bytes.get(key, 0) + n

    def set_compression(self, kind: str, ratio: float) -> None:
        self.compression.labels(kind=kind).set(ratio)

    def exposition(self) -> bytes:
        return generate_latest(self.registry)


class _NodeCollector(Collector):
    """Series read at scrape time: the peer's published record and the node's byte counters."""

    def __init__(
        self,
        record: Callable[[], Mapping[str, Any]],
        traffic: Callable[[], Mapping[tuple[str, str], int]],
        round_bytes: Mapping[tuple[str, str], int],
    ) -> None:
        self.record, self.traffic, self.round_bytes = record, traffic, round_bytes

    def describe(self) -> Iterator:
        return iter(())  # dynamic: label values change with the role

    def collect(self) -> Iterator:
        record = dict(self.record())
        traffic = dict(self.traffic())
        for direction in ("sent", "received"):
            family = CounterMetricFamily(
                f"hetnode_bytes_{direction}", f"Bytes {direction} by channel", labels=["channel"]
            )
            for channel in CHANNELS:
                key = (direction, channel)
                family.add_metric([channel], float(traffic.get(key, 0) + self.round_bytes.get(key, 0)))
            yield family
        link = GaugeMetricFamily(
            "hetnode_link_mbps", "Measured (or declared) link rate", labels=["direction"]
        )
        for direction, field in (("up", "up_mbps"), ("down", "down_mbps")):
            if isinstance(record.get(field), int | float):
                link.add_metric([direction], float(record[field]))
        yield link
        info = GaugeMetricFamily(
            "hetnode_peer_info", "This peer's role, class, chain and stage", labels=list(INFO_LABELS)
        )
        if record:
            info.add_metric([_label(record.get(field)) for field in INFO_LABELS.values()], 1.0)
        yield info
        outer = record.get("params_round")
        if isinstance(outer, int):
            yield GaugeMetricFamily("hetnode_outer_step", "Last sync round applied to θ", value=outer)


INFO_LABELS = {"role": "role", "class": "link_class", "chain": "chain", "stage": "stage", "name": "name"}


def _label(value: object) -> str:
    return "" if value is None else str(value)[:64]
