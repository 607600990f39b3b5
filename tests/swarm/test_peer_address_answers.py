"""What answers at a `--peer` address, told apart, with real processes on 127.0.0.1.

A coordinator restarted with another `--data-dir` has a new key, so a new peer id, on the same port. A
volunteer still holding the old multiaddr must hear that at once (exit 2, both ids, the new multiaddr and
the `http://` form), not wait out `--connect-timeout` for "none of [...] answered". And `hetnode status`
by the coordinator's URL (its `/api/swarm`, no DHT client), or by its multiaddr and status port (the
document it signs, `/api/swarm/signed`), shows what the DHT read shows."""

from __future__ import annotations

import json
import subprocess
import sys
import time
import urllib.parse
from pathlib import Path
from typing import Any

import pytest

from hetnode.net.identity import ephemeral_identity

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
HETNODE = [sys.executable, "-m", "hetnode.cli.main"]
STARTUP_S = 20.0  # a Python interpreter importing torch on a busy 2-core machine
CONNECT_TIMEOUT_S = 60  # the default: what a volunteer waited before this was told apart


def another_id(maddr: str) -> tuple[str, str]:
    """`maddr` with a valid peer id that is not the one listening there, and that id."""
    other = ephemeral_identity().peer_id
    return f"{maddr.rsplit('/p2p/', 1)[0]}/p2p/{other}", other


def assert_names_both(text: str, given: str, actual: str, address: str) -> None:
    assert f"another peer id ({actual}), not {given}" in text, text
    assert "--data-dir" in text and f"{address}/p2p/{actual}" in text, text  # the new multiaddr
    assert "http://127.0.0.1:PORT" in text, text  # and the form that always leads to the current id
    assert "none of" not in text, text


def test_join_with_another_peer_id_fails_at_once_naming_both(swarm: Any):
    boot = swarm.bootstrap(swarm.config())
    boot.wait_ready()
    wrong, given = another_id(boot.maddr)
    started = time.monotonic()
    joiner = swarm.join("stale-address", wrong, "100", extra=["--connect-timeout", str(CONNECT_TIMEOUT_S)])
    code = joiner.proc.wait(CONNECT_TIMEOUT_S + 30)
    took = time.monotonic() - started
    assert code == 2, joiner.tail()  # an argument error: a service must not restart on it
    assert took < STARTUP_S, f"{took:.1f} s, not {CONNECT_TIMEOUT_S} s:\n{joiner.tail()}"
    assert_names_both(joiner.tail(), given, boot.peer_id, boot.maddr.rsplit("/p2p/", 1)[0])
    assert joiner.ready is None  # (the fixture checks that no p2pd is left behind)
    assert boot.proc.poll() is None


def test_status_tells_another_peer_id_too_and_its_url_reads_what_the_dht_does(swarm: Any):
    boot = swarm.bootstrap(swarm.config())
    boot.wait_ready()
    wrong, given = another_id(boot.maddr)
    done = subprocess.run(
        [*HETNODE, "status", "--peer", wrong, "--timeout", "30"],
        capture_output=True,
        text=True,
        timeout=STARTUP_S + 60,
        cwd=ROOT,
    )
    assert done.returncode == 2, done.stderr
    assert_names_both(done.stderr, given, boot.peer_id, boot.maddr.rsplit("/p2p/", 1)[0])

    by_url, by_dht = swarm.status(boot.ready["http"]), swarm.status(boot.maddr)
    for document in (by_url, by_dht):
        assert document["coordinator"] == boot.peer_id and document["run"] == boot.ready["run"]
        assert document["round"] == document["boundary_round"]
    assert abs(by_url["boundary_round"] - by_dht["boundary_round"]) <= 2  # the boundary clock ticks

    def shown(document: dict) -> str:
        peers = [{k: v for k, v in p.items() if k != "last_seen"} for p in document["peers"]]
        return json.dumps({"peers": peers, "chains": document["chains"], "config": document["config"]})

    assert shown(by_url) == shown(by_dht)

    # the multiaddr and the coordinator's status port: the document it signed, no hivemind, no torch
    port = urllib.parse.urlsplit(boot.ready["http"]).port
    probe = (
        "import json, sys; from hetnode.cli.main import main; "
        f"code = main(['status', '--peer', {boot.maddr!r}, '--json', '--coordinator-http-port', '{port}']); "
        "heavy = sorted(m for m in sys.modules if m.split('.')[0] in ('hivemind', 'torch')); "
        "print('IMPORTED', json.dumps(heavy), file=sys.stderr); sys.exit(code)"
    )
    signed = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, timeout=STARTUP_S + 40, cwd=ROOT
    )
    assert signed.returncode == 0, signed.stderr[-2000:]
    assert f"the coordinator {boot.peer_id[-8:]} signed it" in signed.stderr, signed.stderr[-2000:]
    assert "IMPORTED []" in signed.stderr, signed.stderr[-2000:]
    assert shown(json.loads(signed.stdout)) == shown(by_url)
