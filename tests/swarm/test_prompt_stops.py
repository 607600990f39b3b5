"""Every wait of `hetnode join` and `hetnode status` ends promptly: within 2 s of Ctrl+C (SIGINT) or SIGTERM,
and within its own timeout with the reason. A P2P listen port another daemon holds is refused before
anything is announced. Real processes on 127.0.0.1 only."""

from __future__ import annotations

import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

pytestmark = pytest.mark.slow

STOP_WITHIN_S = 2.0
SLACK_S = 2.0  # a loaded CI machine: one scheduling hiccup, one retry interval at most
STARTUP_S = 20.0  # a Python interpreter importing torch on a busy 2-core machine
NOBODY = "QmYyQSo1c1Ym7orWxLYvCrM2EmxFTANf8wXmmE7DWjhx5N"  # a valid peer id nobody has
ROOT = Path(__file__).resolve().parents[2]
HETNODE = [sys.executable, "-m", "hetnode.cli.main"]


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def wait_for_log(daemon: Any, words: str, timeout: float = STARTUP_S + 10) -> float:
    """The moment `words` appeared in the daemon's log (the daemon is then inside the wait)."""
    deadline = time.monotonic() + timeout
    while words not in daemon.tail(200):
        assert daemon.proc.poll() is None, daemon.tail()
        assert time.monotonic() < deadline, f"no {words!r} in the log:\n{daemon.tail()}"
        time.sleep(0.1)
    return time.monotonic()


def seconds_to_exit(daemon: Any, sig: signal.Signals) -> float:
    signalled = time.monotonic()
    daemon.proc.send_signal(sig)
    try:
        daemon.proc.wait(STOP_WITHIN_S + 10)
    except subprocess.TimeoutExpired:
        daemon.proc.kill()
        raise AssertionError(
            f"still running {STOP_WITHIN_S + 10:.0f} s after {sig.name}:\n{daemon.tail()}"
        ) from None
    return time.monotonic() - signalled


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["ctrl-c", "sigterm"])
@pytest.mark.parametrize("form", ["http", "multiaddr"])
def test_join_waiting_for_a_silent_peer_stops_at_once(swarm: Any, sig: signal.Signals, form: str):
    port = free_port()  # nothing listens there
    peer = f"http://127.0.0.1:{port}" if form == "http" else f"/ip4/127.0.0.1/tcp/{port}/p2p/{NOBODY}"
    joiner = swarm.join("patient", peer, "100", extra=["--connect-timeout", "120"])
    wait_for_log(joiner, "waiting for")
    time.sleep(2.0)  # well inside the wait: past the first retry
    took = seconds_to_exit(joiner, sig)
    assert took < STOP_WITHIN_S, f"{took:.1f} s after {sig.name}:\n{joiner.tail()}"
    assert joiner.proc.returncode == 0, joiner.tail()  # stopped while waiting: a clean exit
    assert joiner.ready is None


@pytest.mark.parametrize("form", ["http", "multiaddr"])
def test_join_fails_within_its_connect_timeout_with_the_reason(swarm: Any, form: str):
    port = free_port()
    peer = f"http://127.0.0.1:{port}" if form == "http" else f"/ip4/127.0.0.1/tcp/{port}/p2p/{NOBODY}"
    joiner = swarm.join("hasty", peer, "100", extra=["--connect-timeout", "4"])
    began = wait_for_log(joiner, "waiting for")
    assert joiner.proc.wait(4 + 10) == 1, joiner.tail()
    assert time.monotonic() - began < 4 + SLACK_S, joiner.tail()
    tail = joiner.tail()
    assert "within 4 s (--connect-timeout)" in tail
    assert ("connection refused" if form == "http" else "answered") in tail
    assert joiner.ready is None


def status(peer: str, timeout_s: float) -> subprocess.Popen:
    argv = [*HETNODE, "status", "--peer", peer, "--timeout", f"{timeout_s:g}"]
    return subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT)


def test_status_of_a_url_nobody_serves_fails_at_once_with_the_reason():
    started = time.monotonic()
    proc = status(f"http://127.0.0.1:{free_port()}", 3)
    _, err = proc.communicate(timeout=STARTUP_S + 3 + SLACK_S)
    assert proc.returncode == 1, err
    assert "connection refused" in err and "--timeout" in err, err
    assert time.monotonic() - started < STARTUP_S + 3, err  # was the full timeout plus 2 s


def test_status_of_a_server_that_never_answers_fails_within_its_timeout():
    with socket.socket() as silent:  # accepts the connection, never answers
        silent.bind(("127.0.0.1", 0))
        silent.listen(4)
        silent.settimeout(STARTUP_S + 10)
        proc = status(f"http://127.0.0.1:{silent.getsockname()[1]}", 3)
        connection, _ = silent.accept()  # the query is now waiting on us
        with connection:
            began = time.monotonic()
            _, err = proc.communicate(timeout=3 + SLACK_S + 10)
            took = time.monotonic() - began
    assert proc.returncode == 1, err
    assert "(--timeout 3 s): no answer (timed out)" in err, err
    assert took < 3 + SLACK_S, f"{took:.1f} s: {err}"


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["ctrl-c", "sigterm"])
def test_status_waiting_on_a_silent_server_stops_at_once(sig: signal.Signals):
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen(4)
        silent.settimeout(STARTUP_S + 10)
        proc = status(f"http://127.0.0.1:{silent.getsockname()[1]}", 60)
        connection, _ = silent.accept()
        with connection:
            time.sleep(1.0)
            signalled = time.monotonic()
            proc.send_signal(sig)
            _, err = proc.communicate(timeout=STOP_WITHIN_S + 10)
            took = time.monotonic() - signalled
    assert took < STOP_WITHIN_S, f"{took:.1f} s after {sig.name}: {err}"
    assert proc.returncode == 130 and "interrupted" in err, err


def test_a_p2p_port_in_use_is_refused_before_ready(swarm: Any, tmp_path: Path):
    first = swarm.bootstrap(swarm.config())
    first.wait_ready()
    port = int(first.maddr.split("/tcp/")[1].split("/")[0])
    taken = f"/ip4/127.0.0.1/tcp/{port}"
    second = swarm.start(
        "second",
        ["bootstrap", "--config", str(swarm.config()), "--listen", taken, "--http-port", "0"]
        + ["--data-dir", str(tmp_path / "second")],
    )
    assert second.proc.wait(STARTUP_S + 30) == 1, second.tail()
    assert second.ready is None and not any(line.startswith("READY") for line in second.lines), second.lines
    assert f"cannot listen on 127.0.0.1:{port}: port {port} is in use" in second.tail()
    assert "--listen" in second.tail()
    joiner = swarm.join("squatter", first.maddr, "100", listen=taken)
    assert joiner.proc.wait(STARTUP_S + 30) == 1, joiner.tail()
    assert joiner.ready is None and f"port {port} is in use" in joiner.tail()
    assert first.proc.poll() is None  # the first one keeps its port and its run
    assert swarm.status(first.ready["http"])["run"] == first.ready["run"]  # and is found by its URL
