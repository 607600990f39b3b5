"""A peer's Prometheus series: fed from round records and the node's byte counters, served over HTTP."""

from __future__ import annotations

import urllib.error
import urllib.request
from collections import Counter

import pytest
from prometheus_client import CONTENT_TYPE_LATEST
from prometheus_client.parser import text_string_to_metric_families

from hetnode.service.http_server import HttpServer, Response
from hetnode.service.metrics import PeerMetrics
from hetnode.service.round_log import RoundRecord


def samples(exposition: bytes) -> dict[tuple[str, tuple], float]:
    found = {}
    for family in text_string_to_metric_families(exposition.decode()):
        for sample in family.samples:
            found[sample.name, tuple(sorted(sample.labels.items()))] = sample.value
    return found


def anchor_round(round_: int, tokens: int = 2048, loss: float | None = 3.5) -> RoundRecord:
    return RoundRecord(round_, "anchor", 2.0, tokens, 900, 1800, 0.4, 0.1, steps=10, loss=loss)


def test_rounds_add_up_and_the_node_counts_the_wire_bytes():
    record = {
        "role": "stage",
        "link_class": "slow",
        "chain": "c1",
        "stage": 1,
        "name": "edge",
        "up_mbps": 20.0,
    }
    traffic = Counter({("sent", "sync"): 900, ("received", "state"): 4096})
    metrics = PeerMetrics(record=lambda: record, traffic=lambda: traffic)
    metrics.add_round(anchor_round(1))
    metrics.add_round(anchor_round(2, loss=float("nan")))  # a NaN loss does not overwrite the last good one
    metrics.add_round(
        RoundRecord(3, "stage", 1.0, 100, 0, activation_bytes_sent=700, activation_bytes_received=50, steps=4)
    )
    metrics.set_compression("subspace", 7.5)
    found = samples(metrics.exposition())
    assert found["hetnode_tokens_processed_total", ()] == 2048 * 2 + 100
    assert found["hetnode_inner_steps_total", ()] == 24
    assert found["hetnode_train_loss", ()] == 3.5
    assert found["hetnode_sync_round_seconds_count", ()] == 3
    assert found["hetnode_bytes_sent_total", (("channel", "sync"),)] == 900
    assert found["hetnode_bytes_sent_total", (("channel", "activations"),)] == 700
    assert found["hetnode_bytes_received_total", (("channel", "state"),)] == 4096
    assert found["hetnode_bytes_received_total", (("channel", "probe"),)] == 0
    assert found["hetnode_compression_ratio", (("kind", "subspace"),)] == 7.5
    assert found["hetnode_link_mbps", (("direction", "up"),)] == 20.0
    info = (("chain", "c1"), ("class", "slow"), ("name", "edge"), ("role", "stage"), ("stage", "1"))
    assert found["hetnode_peer_info", info] == 1


def test_two_daemons_in_one_process_keep_separate_registries():
    first, second = PeerMetrics(), PeerMetrics()
    first.add_round(anchor_round(1))
    assert samples(second.exposition())["hetnode_tokens_processed_total", ()] == 0


@pytest.fixture
def served_metrics():
    metrics = PeerMetrics(record=lambda: {"role": "anchor", "name": "a"})
    server = HttpServer(
        "127.0.0.1",
        0,
        {
            "/metrics": lambda: Response(metrics.exposition(), CONTENT_TYPE_LATEST),
            "/boom": lambda: 1 / 0,
        },
    )
    server.start()
    yield metrics, server
    server.stop()


def test_metrics_are_served_and_a_failing_handler_answers_500(served_metrics):
    metrics, server = served_metrics
    metrics.add_round(anchor_round(1))
    with urllib.request.urlopen(f"{server.url}/metrics?x=1", timeout=10) as response:
        assert response.headers["Content-Type"].startswith("text/plain")
        assert samples(response.read())["hetnode_tokens_processed_total", ()] == 2048
    for path, status in (("/boom", 500), ("/nope", 404)):
        with pytest.raises(urllib.error.HTTPError) as failure:
            urllib.request.urlopen(f"{server.url}{path}", timeout=10)
        assert failure.value.code == status
    with urllib.request.urlopen(f"{server.url}/metrics", timeout=10) as response:  # still serving
        assert response.status == 200


def test_a_taken_port_is_a_clear_error(served_metrics):
    from hetnode.errors import HetnodeError

    _, server = served_metrics
    with pytest.raises(HetnodeError, match="cannot serve HTTP on 127.0.0.1"):
        HttpServer("127.0.0.1", server.port, {}).start()
