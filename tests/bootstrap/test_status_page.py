"""The status page and JSON API over a real HTTP server: health before and after updates, JSON that
survives NaN, the leaderboard in token order, and peer-chosen names shown as text, never as markup."""

import base64
import hashlib
import json
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from bootstrap.ledger import Contribution, Ledger
from bootstrap.status_html import clean_text, loss_chart, render_page
from bootstrap.status_page import StatusBoard
from hetnode.service.http_server import HttpServer

EVIL = "<script>alert(1)</script>"
NOW = 1_700_000_000.0


class Clock:
    def __init__(self) -> None:
        self.now = NOW

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def ledger(tmp_path: Path):
    with Ledger(tmp_path / "ledger.sqlite") as ledger:
        ledger.record_round(
            0,
            NOW - 30,
            [
                Contribution("peer-a", "alice", "anchor", 1000, 10, 100),
                Contribution("peer-x", EVIL, "stage", 3000, 10, 100),
                Contribution("peer-b", "bob", "stage", 500, 10, 100),
            ],
        )
        ledger.record_round(1, NOW - 10, [Contribution("peer-b", "bob", "anchor", 2000, 10, 100)])
        yield ledger


@pytest.fixture
def clock() -> Clock:
    return Clock()


@pytest.fixture
def board(ledger: Ledger, clock: Clock) -> StatusBoard:
    return StatusBoard(ledger, stale_after_s=60.0, clock=clock)


@pytest.fixture
def server(board: StatusBoard):
    http = HttpServer("127.0.0.1", 0, board.routes())
    http.start()
    try:
        yield http
    finally:
        http.stop()


def get(server: HttpServer, path: str) -> tuple[int, str, bytes]:
    try:
        with urllib.request.urlopen(server.url + path, timeout=10) as response:
            return response.status, response.headers["Content-Type"], response.read()
    except urllib.error.HTTPError as error:
        with error:
            return error.code, error.headers["Content-Type"], error.read()


SAMPLES = [
    {"round": 2, "prompt": "The history of", "text": " the " + EVIL + "\x00\x1b[31m\ufffd\u202e", "seed": 2},
    {"round": 1, "prompt": "The history of", "text": " thhe cat", "seed": 1},
]


def snapshot(**overrides) -> dict:
    base = {
        "run": "run-1",
        "config": "tiny",
        "peer_id": "QmCoordinator",
        "maddrs": ["/ip4/127.0.0.1/tcp/31337"],
        "started": NOW - 7200,
        "params_round": 2,
        "eval_loss": 3.25,
        "peers": [
            {
                "peer": "peer-x",
                "name": EVIL,
                "role": "<i>stage</i>",
                "link_class": "low",
                "chain": "<b>chain-0</b>",
                "stage": 1,
                "params_round": 2,
                "up_mbps": 12.5,
                "down_mbps": None,
                "last_seen": NOW - 3,
                "utilization": 0.934,
            },
            {
                "peer": "peer-a",
                "name": "alice",
                "role": "anchor",
                "link_class": "high",
                "up_mbps": 1000.0,
                "down_mbps": 1000.0,
                "last_seen": NOW,
            },
        ],
        "chains": [
            {"chain": "<b>chain-0</b>", "members": ["peer-x", "peer-unknown"], "live": True},
            {
                "chain": "c9-went-on",
                "members": ["peer-x", "peer-a"],
                "live": False,
                "lineage": "<i>c3-founded</i>",
                "blamed": ["peer-a"],
            },
            {
                "chain": "c9-pooled",
                "members": ["peer-x", "peer-a"],
                "workers": [["peer-x"], ["peer-a", "peer-p"]],
                "served": {"peer-a": 0.6, "peer-p": 0.4},
                "dropped": {"peer-gone": "left"},
                "live": True,
            },
        ],
        "history": [
            {
                "round": r,
                "contributors": 3,
                "excluded": 0,
                "tokens": 4500,
                "eval_loss": 4.0 - r / 2,
                "seal_seconds": 1.5,
                "time": NOW - 60 + r,
                "payload_bytes": {"anchor": 2_000_000, "stage": 30_000},
            }
            for r in range(3)
        ],
        "samples": SAMPLES,
    }
    return base | overrides


def test_healthz_before_and_after_updates(server: HttpServer, board: StatusBoard, clock: Clock):
    status, content_type, body = get(server, "/healthz")
    assert (status, content_type) == (503, "application/json")
    assert json.loads(body)["ok"] is False

    board.update(snapshot())
    clock.now += 5
    status, _, body = get(server, "/healthz")
    assert status == 200
    assert json.loads(body) == {"ok": True, "round": 2, "age_s": 5.0}

    clock.now += 60  # no update for 65 s: stale
    status, _, body = get(server, "/healthz")
    health = json.loads(body)
    assert status == 503 and health["ok"] is False and "65 s" in health["reason"]

    board.update(snapshot(params_round=3))
    status, _, body = get(server, "/healthz")
    assert status == 200 and json.loads(body)["round"] == 3


def test_api_status_has_the_snapshot_and_the_leaderboard_in_token_order(
    server: HttpServer, board: StatusBoard
):
    status, _, body = get(server, "/api/status")
    assert status == 200
    assert json.loads(body)["updated"] is None  # served before the first update, from the ledger alone

    mine = snapshot()
    board.update(mine)
    mine["run"] = "mutated after update"  # the board holds its own copy
    mine["peers"][0]["name"] = "mutated"
    status, content_type, body = get(server, "/api/status")
    assert (status, content_type) == (200, "application/json")
    data = json.loads(body)
    assert data["run"] == "run-1" and data["peers"][0]["name"] == EVIL
    assert data["updated"] == NOW
    assert [s["peer"] for s in data["leaderboard"]] == ["peer-x", "peer-b", "peer-a"]
    assert [s["tokens"] for s in data["leaderboard"]] == [3000, 2500, 1000]
    bob = data["leaderboard"][1]
    assert (bob["name"], bob["role"], bob["rounds"], bob["last_round"]) == ("bob", "anchor", 2, 1)
    assert bob["share"] == pytest.approx(2500 / 6500)


def test_api_contributions(server: HttpServer):
    status, content_type, body = get(server, "/api/contributions")
    assert (status, content_type) == (200, "application/json")
    data = json.loads(body)
    assert (data["total_tokens"], data["rounds"]) == (6500, 2)
    assert [(s["peer"], s["tokens"]) for s in data["standings"]] == [
        ("peer-x", 3000),
        ("peer-b", 2500),
        ("peer-a", 1000),
    ]


def test_nan_and_infinity_become_null(server: HttpServer, board: StatusBoard):
    history = snapshot()["history"]
    history[0]["eval_loss"] = float("nan")
    board.update(snapshot(eval_loss=float("nan"), started=float("inf"), history=history))
    for path in ("/api/status", "/healthz", "/"):
        assert get(server, path)[0] == 200
    status, _, body = get(server, "/api/status")
    assert b"NaN" not in body and b"Infinity" not in body
    data = json.loads(body)
    assert data["eval_loss"] is None and data["started"] is None
    assert data["history"][0]["eval_loss"] is None and data["history"][1]["eval_loss"] == 3.5


def test_html_escapes_peer_chosen_text(server: HttpServer, board: StatusBoard):
    board.update(snapshot(run=EVIL))
    status, content_type, body = get(server, "/")
    assert (status, content_type) == (200, "text/html; charset=utf-8")
    page = body.decode()
    assert page.count("<script") == 1  # the page's own, allowed by its hash alone
    assert "alert(1)</script>" not in page and "<b>chain" not in page and "<i>stage" not in page
    assert "&lt;script&gt;alert(1)&lt;/script&gt;" in page
    assert "&lt;b&gt;chain-0&lt;/b&gt;" in page
    # a chain that went on with a spare says where from, and whom its members caught lying (by name)
    assert "<th>history</th>" in page and "<i>c3" not in page
    assert "from &lt;i&gt;c3-founded&lt;/i&gt;; caught lying: alice" in page
    # a stage's pool: its workers, the share of the micro-batches each served, who was dropped and why
    assert "alice (60%), peer-p (40%)" in page and "dropped: peer-gone (left)" in page
    assert '<noscript><meta http-equiv="refresh" content="5"></noscript>' in page
    assert "<svg" in page and "<polyline" in page
    # the leaderboard: rank, name, tokens, share, rounds, role, last seen
    assert "3,000" in page and "46.2 %" in page and "10 s ago" in page
    assert page.index("&lt;script&gt;") < page.index("bob") < page.index("alice")
    assert "↑ 1000 / ↓ 1000 Mbit/s" in page and "↑ 12.5 / ↓ - Mbit/s" in page and "e+03" not in page
    # each replica's compute utilisation, as it reports it ("–" where it reports none)
    assert "<th>utilisation</th>" in page and '<td class="n">93 %</td>' in page
    assert '<td class="n">–</td><td>↑ 1000 / ↓ 1000 Mbit/s' in page


def test_unknown_path_is_404(server: HttpServer):
    assert get(server, "/nope")[0] == 404
    assert get(server, "/api/status/")[0] == 404


def test_page_tolerates_missing_and_odd_values():
    page = render_page({}, [], NOW)
    assert "No contributions credited yet." in page and "No evaluated rounds yet." in page
    odd = {
        "run": None,
        "params_round": "two",
        "peers": [None, "x", {"peer": ["not", "hashable"], "stage": None, "chain": None}],
        "chains": [{"members": "peer-a"}, {"chain": None, "members": None}],
        "history": [{"round": None, "eval_loss": "low", "payload_bytes": None}, 7],
        "maddrs": None,
    }
    page = render_page(odd, [], NOW)
    assert "<html" in page and "No evaluated rounds yet." in page


@pytest.mark.parametrize("n", [1, 2, 5])
def test_loss_chart_scales_to_the_data(n: int):
    points = [(float(r), 2.0) for r in range(n)]  # flat losses: no division by zero
    svg = loss_chart(points)
    assert svg.startswith("<svg") and "nan" not in svg.lower()
    assert ("<circle" in svg) == (n == 1) and ("<polyline" in svg) == (n > 1)


def test_samples_on_the_page_and_in_the_api(server: HttpServer, board: StatusBoard):
    assert json.loads(get(server, "/api/samples")[2]) == {"samples": [], "updated": None}
    board.update(snapshot())
    page = get(server, "/")[2].decode()
    # the prompt in bold, the model's text as text: markup escaped, controls and bidi overrides replaced
    assert (
        "<b>The history of</b> the &lt;script&gt;alert(1)&lt;/script&gt;\ufffd\ufffd[31m\ufffd\ufffd</q>"
        in page
    )
    assert page.index("round 2</span>") < page.index("round 1</span>") and "thhe cat" in page
    for path in ("/api/samples", "/api/status"):
        samples = json.loads(get(server, path)[2])["samples"]
        assert [s["round"] for s in samples] == [2, 1] and samples[0]["text"] == SAMPLES[0]["text"]


def test_the_refresh_script_is_the_only_one_the_policy_allows():
    page = render_page(snapshot(), [], NOW)
    script = page.split("<script>")[1].split("</script>")[0]
    digest = base64.b64encode(hashlib.sha256(script.encode()).digest()).decode()
    policy = page.split('http-equiv="Content-Security-Policy" content="')[1].split('"')[0]
    assert f"script-src 'sha256-{digest}'" in policy and "unsafe" not in policy.split("script-src")[1]
    assert "default-src 'none'" in policy and "connect-src 'self'" in policy
    # every part the script swaps exists once, with an id
    for id_ in ("meta", "leaderboard", "loss", "samples", "peers", "chains", "rounds", "refused"):
        assert page.count(f'id="{id_}"') == 1


def test_clean_text_keeps_text_and_replaces_what_could_break_the_page():
    assert clean_text("a\tb\nc é 漢字 🙂") == "a\tb\nc é 漢字 🙂"
    assert clean_text("\x00\x07\x7f\x85\u202e\u2066") == "\ufffd" * 6
    assert clean_text("\ud800x") == "\ufffdx"  # a lone surrogate could not be encoded as UTF-8


def test_a_pools_shares_come_from_the_newest_round_that_had_it():
    from bootstrap.coordinator import served_shares

    history = [
        {"round": 1, "steps": {"a": 10, "b": 6, "c": 4}},
        {"round": 2, "steps": {"a": 10, "b": 9, "c": 1}},
        {"round": 3, "steps": {"x": 10}},  # a round without the pool: not its share
    ]
    assert served_shares([["a"], ["b", "c"]], history) == {"b": 0.9, "c": 0.1}
    assert served_shares([["a"], ["b"]], history) == {}  # no pool, no shares
    assert served_shares([["b", "c"]], []) == {}
