"""What volunteers see: a real Prometheus scrapes a live swarm (coordinator + 2 anchors) and every PromQL
expression of the Grafana dashboard returns data; the ledger credits exactly the sealed contributions, and
the status API agrees with the coordinator's round history."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import time
import urllib.parse
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from hetnode.config import OuterConfig

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
DASHBOARD = ROOT / "configs" / "grafana" / "dashboards" / "hetnode.json"
TOKENS_PER_ROUND = 10 * 16 * 128  # H inner steps x batch x sequence, tiny config


def dashboard_exprs(panels: list[dict]) -> Iterator[tuple[str, str]]:
    for panel in panels:
        yield from dashboard_exprs(panel.get("panels", []))  # rows nest panels
        for target in panel.get("targets", []):
            if target.get("expr"):
                yield panel.get("title", "?"), target["expr"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def get_json(url: str) -> dict:
    with urllib.request.urlopen(url, timeout=10) as response:
        return json.loads(response.read())


def host_port(url: str) -> str:
    return urllib.parse.urlsplit(url).netloc


@pytest.fixture
def prometheus(tmp_path: Path):
    """Start a real Prometheus on loopback; the test passes its scrape targets."""
    binary = shutil.which("prometheus")
    if binary is None:
        if os.environ.get("CI"):
            pytest.fail("prometheus is not installed (.ci/run installs Debian's package)")
        pytest.skip("prometheus is not installed (apt-get install prometheus)")
    processes = []

    def start(targets: list[str]) -> str:
        port = free_port()
        config = tmp_path / "prometheus.yml"
        config.write_text(
            "global:\n  scrape_interval: 1s\n  evaluation_interval: 1s\n"
            "scrape_configs:\n  - job_name: hetnode\n    static_configs:\n"
            f"      - targets: {json.dumps(targets)}\n"
        )
        log = open(tmp_path / "prometheus.log", "w")  # noqa: SIM115 - closed at teardown
        proc = subprocess.Popen(
            [
                binary,
                f"--config.file={config}",
                f"--storage.tsdb.path={tmp_path / 'tsdb'}",
                f"--web.listen-address=127.0.0.1:{port}",
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        processes.append((proc, log))
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            try:
                with urllib.request.urlopen(f"{url}/-/ready", timeout=2) as response:
                    if response.status == 200:
                        return url
            except OSError:
                time.sleep(0.3)
        raise AssertionError(
            f"prometheus did not get ready:\n{(tmp_path / 'prometheus.log').read_text()[-2000:]}"
        )

    yield start
    for proc, log in processes:
        proc.terminate()
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)
        log.close()


def query(prometheus_url: str, expr: str) -> dict:
    return get_json(f"{prometheus_url}/api/v1/query?" + urllib.parse.urlencode({"query": expr}))


def test_every_dashboard_query_returns_data_and_the_ledger_credits_sealed_rounds(swarm, prometheus):
    boot = swarm.bootstrap(swarm.config(outer={"inner_steps": 10}))
    status_url = boot.wait_ready()["http"]
    anchors = [swarm.join(f"anchor-{i}", boot.maddr, "1000") for i in (1, 2)]
    metrics_urls = [anchor.wait_ready()["metrics"] for anchor in anchors]
    prometheus_url = prometheus([host_port(status_url)] + [host_port(url) for url in metrics_urls])

    history = swarm.wait_for_round(2, timeout=180)
    exprs = list(dashboard_exprs(json.loads(DASHBOARD.read_text())["panels"]))
    assert len(exprs) >= 8
    empty: list[tuple[str, str]] = []
    deadline = time.monotonic() + 60  # rate() needs two scrapes after the series appear
    while time.monotonic() < deadline:
        empty = []
        for title, expr in exprs:
            answer = query(prometheus_url, expr)
            assert answer["status"] == "success", (title, expr, answer)
            if not answer["data"]["result"]:
                empty.append((title, expr))
        if not empty:
            break
        time.sleep(2)
    assert not empty, f"dashboard queries without data: {empty}"

    # the ledger: every anchor's credit is exactly its tokens in the rounds it was sealed into
    standings = {s["peer"]: s for s in get_json(f"{status_url}/api/contributions")["standings"]}
    history = swarm.history()  # read after: it holds every round the ledger had credited (or one less)
    for anchor in anchors:
        credited = standings[anchor.peer_id]
        sealed_in = sum(1 for entry in history if anchor.peer_id in entry["contributors"])
        assert (
            2 <= credited["rounds"] <= sealed_in + 1
        )  # a ledger row is written just before its history line
        # each credited round: its schedule by the weight it had earned, w of F (at least 1, at most F)
        full = OuterConfig().probation_rounds
        rounds = credited["rounds"]
        assert rounds * (TOKENS_PER_ROUND // full) <= credited["tokens"] <= rounds * TOKENS_PER_ROUND
        assert credited["inner_steps"] == credited["rounds"] * 10 and credited["role"] == "anchor"
    tokens = query(prometheus_url, "sum(hetnode_contribution_tokens_total)")["data"]["result"]
    assert float(tokens[0]["value"][1]) >= 4 * (TOKENS_PER_ROUND // OuterConfig().probation_rounds)

    # the page is refreshed once per heartbeat: it may show the round before the ledger's last one
    deadline = time.monotonic() + 60
    status = get_json(f"{status_url}/api/status")
    while status["params_round"] < 2 and time.monotonic() < deadline:
        time.sleep(0.5)
        status = get_json(f"{status_url}/api/status")
    assert {p["name"] for p in status["leaderboard"]} == {"anchor-1", "anchor-2"}
    # the eval loss of a round comes beside the next seals: the newest rounds may not have it yet
    losses = [h["eval_loss"] for h in status["history"] if h["eval_loss"] is not None]
    assert status["params_round"] >= 2 and losses and losses[-1] > 0
    with urllib.request.urlopen(f"{status_url}/healthz", timeout=10) as response:
        assert response.status == 200
    with urllib.request.urlopen(f"{status_url}/", timeout=10) as response:
        page = response.read().decode()
    assert "anchor-1" in page and "<svg" in page
