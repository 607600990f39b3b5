"""The status page in a real browser: headless Chromium, driven over the W3C WebDriver protocol by
`chromedriver` (plain JSON over HTTP, so no client library), loads the page from the real `StatusBoard` and
HTTP server. The page must load without a console error or a failed load, show the leaderboard, peers,
loss chart and samples once its script ran, run no script a sample smuggles in, and update itself without
a reload when the coordinator's snapshot changes. Set HETNODE_SAVE_SCREENSHOT=1 to also write the
screenshot to `benchmarks/results/status_page.png` (the one `docs/observability.md` shows).
"""

from __future__ import annotations

import base64
import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from bootstrap.ledger import Contribution, Ledger
from bootstrap.status_html import REFRESH_S
from bootstrap.status_page import StatusBoard
from hetnode.service.http_server import HttpServer

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
SCREENSHOT = ROOT / "benchmarks" / "results" / "status_page.png"
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
CHROMEDRIVER = shutil.which("chromedriver")
# Headless, and nothing that reaches out: without the background-networking flags Chromium tries the network
CHROMIUM_ARGS = [
    "--headless=new",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--disable-dev-shm-usage",
    "--window-size=1280,1000",
]
START_S = 60.0  # a cold Chromium on a loaded 2-core machine
EVIL = '<script>window.pwned = 1</script><img src=x onerror="window.pwned = 2">'


class WebDriver:
    """The few W3C WebDriver commands this test needs, over chromedriver's HTTP API."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.session = ""

    def call(self, method: str, path: str, body: Any = None, timeout: float = 30.0) -> Any:
        data = None if body is None else json.dumps(body).encode()
        request = urllib.request.Request(
            self.url + path, data=data, method=method, headers={"Content-Type": "application/json"}
        )
        try:
            with urllib.request.urlopen(request, timeout=timeout) as response:
                return json.loads(response.read())["value"]
        except urllib.error.HTTPError as error:
            with error:
                raise AssertionError(f"{method} {path}: {error.read().decode(errors='replace')}") from None

    def start(self, user_data_dir: Path) -> None:
        options = {"binary": CHROMIUM, "args": [*CHROMIUM_ARGS, f"--user-data-dir={user_data_dir}"]}
        capabilities = {
            "browserName": "chrome",
            "goog:chromeOptions": options,
            "goog:loggingPrefs": {"browser": "ALL"},
        }
        value = self.call("POST", "/session", {"capabilities": {"alwaysMatch": capabilities}}, START_S)
        self.session = value["sessionId"]

    def cmd(self, method: str, path: str, body: Any = None) -> Any:
        return self.call(method, f"/session/{self.session}{path}", body)

    def js(self, script: str, *args: Any) -> Any:
        return self.cmd("POST", "/execute/sync", {"script": script, "args": list(args)})

    def console(self) -> list[dict[str, Any]]:
        """The browser's console since the last call (JS errors, failed loads, CSP refusals, logs)."""
        return self.cmd("POST", "/se/log", {"type": "browser"})

    def screenshot(self) -> bytes:
        """The whole page, not just the window (Chrome DevTools `Page.captureScreenshot`)."""
        shot = self.cmd(
            "POST",
            "/goog/cdp/execute",
            {"cmd": "Page.captureScreenshot", "params": {"format": "png", "captureBeyondViewport": True}},
        )
        return base64.b64decode(shot["data"])

    def wait_for(self, script: str, what: str, timeout: float) -> Any:
        """Poll `script` in the page until it returns something truthy."""
        deadline = time.monotonic() + timeout
        while True:
            value = self.js(script)
            if value:
                return value
            if time.monotonic() > deadline:
                raise AssertionError(f"not within {timeout:.0f} s: {what}")
            time.sleep(0.2)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def browser(tmp_path: Path) -> Iterator[WebDriver]:
    if CHROMIUM is None or CHROMEDRIVER is None:
        pytest.skip(
            "needs chromium and chromedriver (Debian: chromium chromium-driver; .ci/run installs them)"
        )
    port = free_port()
    log = (tmp_path / "chromedriver.log").open("w")
    # its own process group: teardown ends chromedriver and every Chromium process it started, whatever
    # state they are in
    driver = subprocess.Popen(
        [CHROMEDRIVER, f"--port={port}", "--allowed-ips=127.0.0.1"],
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    web = WebDriver(f"http://127.0.0.1:{port}")
    try:
        deadline = time.monotonic() + START_S
        while True:
            try:
                if web.call("GET", "/status", timeout=2.0).get("ready"):
                    break
            except (OSError, AssertionError):
                pass
            if driver.poll() is not None or time.monotonic() > deadline:
                pytest.fail(f"chromedriver did not start:\n{(tmp_path / 'chromedriver.log').read_text()}")
            time.sleep(0.1)
        web.start(tmp_path / "chromium-profile")
        yield web
    finally:
        if web.session:  # closes Chromium the polite way first
            with contextlib.suppress(OSError, AssertionError):
                web.call("DELETE", f"/session/{web.session}", timeout=10.0)
        try:
            os.killpg(driver.pid, signal.SIGTERM)
            driver.wait(timeout=10)
        except ProcessLookupError:
            pass
        except subprocess.TimeoutExpired:
            os.killpg(driver.pid, signal.SIGKILL)
            driver.wait(timeout=10)
        log.close()


def snapshot(now: float, params_round: int) -> dict[str, Any]:
    """What `bootstrap/coordinator.py` builds after `params_round` rounds of a small swarm."""
    history = [
        {
            "round": r,
            "contributors": 3,
            "excluded": int(r == 3),
            "tokens": 3 * 30 * 16 * 128,
            "eval_loss": 5.6 * 0.93**r + 0.05 * (r % 2),
            "seal_seconds": 1.2 + 0.1 * r,
            "time": now - 30 * (params_round - r),
            "payload_bytes": {"anchor": 2 * 410_000, "stage": 2 * 150_000},
            "dense_bytes": 3 * 3_600_000,
        }
        for r in range(params_round + 1)
    ]
    texts = [
        " the ciy of th e ws a tthe",
        " the first century, the city was",
        " the United States is a country in the",
        " " + EVIL,
        " the Roman Empire began in the 1st century BC\nwhen \x00 Augustus \u202eeunevar",
    ]
    samples = [
        {
            "round": r,
            "prompt": "The history of",
            "text": " the new round's words" if r == 12 else texts[r % len(texts)],
            "tokens": 64,
            "temperature": 0.8,
            "seed": r,
            "seconds": 0.21,
        }
        for r in range(params_round, max(-1, params_round - 6), -1)
    ]
    peers = [
        ("anchor-eu", "anchor", "high", None, None),
        ("anchor-us", "anchor", "high", None, None),
        ("laptop-1", "stage", "low", "c12-9f3a", 0),
        ("laptop-2", "stage", "low", "c12-9f3a", 1),
        ("raspberry", "idle", "slow", None, None),
    ]
    return {
        "run": "small-1a2b3c4d",
        "config": "small",
        "peer_id": "12D3KooWCoordinatorExampleKey",
        "maddrs": ["/ip4/203.0.113.7/tcp/31337"],
        "started": now - 3 * 3600,
        "params_round": params_round,
        "eval_loss": history[-1]["eval_loss"],
        "peers": [
            {
                "peer": f"12D3KooW{name}",
                "name": name,
                "role": role,
                "link_class": link,
                "chain": chain,
                "stage": stage,
                "params_round": None if role == "idle" else params_round,
                "up_mbps": 900.0 if link == "high" else 22.5,
                "down_mbps": 950.0 if link == "high" else 80.0,
                "last_seen": now - 2,
            }
            for name, role, link, chain, stage in peers
        ],
        "chains": [{"chain": "c12-9f3a", "members": ["12D3KooWlaptop-1", "12D3KooWlaptop-2"], "live": True}],
        "history": history,
        "samples": samples,
    }


@pytest.fixture
def coordinator(tmp_path: Path) -> Iterator[tuple[StatusBoard, HttpServer]]:
    now = time.time()
    with Ledger(tmp_path / "ledger.sqlite") as ledger:
        for r in range(12):
            ledger.record_round(
                r,
                now - 30 * (12 - r),
                [
                    Contribution("12D3KooWanchor-eu", "anchor-eu", "anchor", 61_440, 30, 820_000),
                    Contribution(
                        "12D3KooWanchor-us", "anchor-us", "anchor", 61_440 - 900 * (r % 3), 30, 820_000
                    ),
                    Contribution("12D3KooWlaptop-1", "laptop-1", "stage", 30_720, 30, 150_000),
                    Contribution("12D3KooWlaptop-2", "laptop-2", "stage", 30_720, 30, 150_000),
                ],
            )
        board = StatusBoard(ledger)
        board.update(snapshot(now, 11))
        server = HttpServer("127.0.0.1", 0, board.routes())
        server.start()
        try:
            yield board, server
        finally:
            server.stop()


# what the page shows, read from the DOM after its scripts ran (a JS expression)
PAGE_STATE = """(() => {
const q = (s) => document.querySelector(s), all = (s) => document.querySelectorAll(s);
return {
  leaderboard: Array.from(all('#leaderboard tbody tr'), (tr) => tr.cells[1].textContent),
  peers: Array.from(all('#peers tbody tr'), (tr) => tr.cells[0].textContent),
  chart: !!q('#loss svg polyline') && q('#loss svg polyline').getAttribute('points').split(' ').length,
  samples: Array.from(all('#samples li'), (li) => [li.querySelector('.r').textContent,
                                                  li.querySelector('q b').textContent,
                                                  li.querySelector('q').textContent]),
  meta: q('#meta').textContent,
  live: q('#live').textContent,
  scripts: all('script').length,
  images: all('img').length,
  pwned: window.pwned === undefined ? null : window.pwned,
  marker: window.__notReloaded === undefined ? null : window.__notReloaded,
  scrollY: window.scrollY,
};
})()"""


def console_errors(web: WebDriver) -> list[str]:
    return [e["message"] for e in web.console() if e.get("level") in ("SEVERE", "WARNING")]


def test_status_page_renders_and_refreshes_in_chromium(
    browser: WebDriver, coordinator: tuple[StatusBoard, HttpServer], tmp_path: Path
):
    board, server = coordinator
    browser.cmd("POST", "/url", {"url": server.url + "/"})
    browser.wait_for("return document.readyState === 'complete'", "the page loads", 30)
    state = browser.js(f"return {PAGE_STATE};")
    assert state["leaderboard"][:2] == ["anchor-eu", "anchor-us"] and len(state["leaderboard"]) == 4
    assert state["peers"] == ["anchor-eu", "anchor-us", "laptop-1", "laptop-2", "raspberry"]
    assert state["chart"] == 12  # a point per evaluated round
    rounds = [s[0] for s in state["samples"]]
    assert rounds == [f"round {r}" for r in range(11, 5, -1)]
    assert all(prompt == "The history of" for _, prompt, _ in state["samples"])
    evil = next(text for r, _, text in state["samples"] if r == "round 8")
    assert EVIL in evil  # shown as text: the page's own script is the only one, and nothing ran
    assert (state["scripts"], state["images"], state["pwned"]) == (1, 0, None)
    assert "round 11" in state["meta"]

    shot = browser.screenshot()
    assert shot.startswith(b"\x89PNG")
    (tmp_path / "status_page.png").write_bytes(shot)
    if os.environ.get("HETNODE_SAVE_SCREENSHOT") == "1":
        SCREENSHOT.parent.mkdir(parents=True, exist_ok=True)
        SCREENSHOT.write_bytes(shot)

    # a new round arrives: the page shows it within a refresh, without reloading, where the reader was
    browser.js("window.__notReloaded = 1; window.scrollTo(0, 300);")
    board.update(snapshot(time.time(), 12))
    updated = browser.wait_for(
        f"const s = {PAGE_STATE}; return s.samples.length && s.samples[0][0] === 'round 12' && s;",
        "the page shows round 12",
        timeout=3 * REFRESH_S + 5,
    )
    assert updated["samples"][0][2] == "The history of the new round's words"
    assert "round 12" in updated["meta"] and updated["chart"] == 13 and updated["marker"] == 1
    assert updated["scrollY"] == 300 and updated["live"].startswith("live, updated")
    assert not console_errors(browser)  # no JS error, failed load or refused resource, refreshes included

    # the coordinator goes away: the page says so and keeps what it showed
    server.stop()
    state = browser.wait_for(
        f"const s = {PAGE_STATE}; return s.live.startsWith('cannot reach') && s;",
        "the page notices the coordinator is gone",
        timeout=3 * REFRESH_S + 5,
    )
    assert state["samples"][0][0] == "round 12" and state["marker"] == 1
