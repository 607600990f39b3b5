"""`hetnode status --peer http://…` prints the document the coordinator serves at /api/swarm: one HTTP
request, no P2P daemon and no hivemind import; an older coordinator without the route is read through the
DHT as before. The coordinator's side is the real StatusBoard on a real HTTP server."""

from __future__ import annotations

import json
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path

import pytest

import hetnode.daemon.status as status
from bootstrap.ledger import Ledger
from bootstrap.status_page import StatusBoard
from hetnode.cli.main import EXIT_ERROR, main
from hetnode.service.http_server import HttpServer, Response

ROOT = Path(__file__).resolve().parents[2]
COORDINATOR = "12D3KooWGRUVh2RNnvh6dquqNn6K7Tq4b1q2nZMB4RVtYfF7bKoF"
DIGESTS = {"embed": "e0", "0": "a0", "head": "h0"}
SWARM = {
    "run": "tiny-0123abcd",
    "round": 7,
    "boundary_round": 7,
    "peers": [
        {"peer_id": COORDINATOR, "name": "coordinator", "role": "coordinator", "params_round": 3,
         "layer_digests": DIGESTS, "last_seen": 99.0},
        {"peer_id": "Q" * 46, "name": "anchor-1", "role": "anchor", "params_round": 3, "layers": [0, 0],
         "layer_digests": DIGESTS, "last_seen": 98.0},
    ],
    "chains": [],
    "coordinator": COORDINATOR,
    "config": "tiny",
    "time": 100.0,
}  # fmt: skip


@pytest.fixture
def board(tmp_path: Path):
    with Ledger(tmp_path / "ledger.sqlite") as ledger:
        yield StatusBoard(ledger)


@pytest.fixture
def served(board: StatusBoard):
    server = HttpServer("127.0.0.1", 0, board.routes())
    server.start()
    try:
        yield server
    finally:
        server.stop()


def test_status_prints_the_served_document(board: StatusBoard, served: HttpServer, capsys):
    board.update({"run": "tiny-0123abcd", "peer_id": COORDINATOR, "swarm": SWARM})
    assert main(["status", "--peer", served.url, "--json"]) == 0
    assert json.loads(capsys.readouterr().out) == SWARM
    assert main(["status", "--peer", served.url]) == 0
    table = capsys.readouterr().out
    assert table.startswith("run tiny-0123abcd (tiny), boundary 7, 2 peers") and "agree 3/3" in table
    with urllib.request.urlopen(f"{served.url}/api/status", timeout=10) as response:
        assert "swarm" not in json.loads(response.read())  # served once, at /api/swarm


def test_before_the_first_read_status_says_to_ask_again(served: HttpServer, capsys):
    assert main(["status", "--peer", served.url]) == EXIT_ERROR
    assert "has not read the swarm yet" in capsys.readouterr().err
    with pytest.raises(urllib.error.HTTPError) as refused:
        urllib.request.urlopen(f"{served.url}/api/swarm", timeout=10)
    assert refused.value.code == 503


def test_an_older_coordinator_is_read_through_the_dht(monkeypatch, capsys):
    """No /api/swarm (404): its /api/status names the P2P address, which the DHT query then reads."""
    old = {"peer_id": COORDINATOR, "maddrs": [f"/ip4/0.0.0.0/tcp/31337/p2p/{COORDINATOR}"]}
    server = HttpServer("127.0.0.1", 0, {"/api/status": lambda: Response(json.dumps(old).encode())})
    asked = []

    async def query_status(maddr: str, timeout_s: float, listen: str, stop: object) -> dict:
        asked.append(maddr)
        return SWARM

    monkeypatch.setattr(status, "query_status", query_status)
    server.start()
    try:
        assert main(["status", "--peer", server.url, "--json"]) == 0
    finally:
        server.stop()
    assert asked == [f"/ip4/127.0.0.1/tcp/31337/p2p/{COORDINATOR}"]
    assert json.loads(capsys.readouterr().out)["boundary_round"] == 7


def test_status_by_url_loads_no_hivemind(board: StatusBoard, served: HttpServer):
    """In a fresh interpreter, as a user runs it: the answer needs neither p2pd nor the DHT client."""
    board.update({"swarm": SWARM})
    script = (
        "import sys; from hetnode.cli.main import main; code = main(['status', '--peer', sys.argv[1]]); "
        "print('LOADED', sorted(m for m in sys.modules if m.split('.')[0] in ('hivemind', 'multiaddr'))); "
        "sys.exit(code)"
    )
    done = subprocess.run(
        [sys.executable, "-c", script, served.url], capture_output=True, text=True, timeout=120, cwd=ROOT
    )
    assert done.returncode == 0, done.stderr
    assert "agree 3/3" in done.stdout
    assert "LOADED []" in done.stdout, done.stdout
