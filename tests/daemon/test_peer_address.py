"""`--peer http://coordinator:8400`: the multiaddr comes from the coordinator's status API, checked."""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time

import pytest

from hetnode.daemon.peer_address import MAX_STATUS_BYTES, is_url, maddr_from_status, resolve_peer
from hetnode.errors import HetnodeError
from hetnode.service.http_server import HttpServer, Response
from hetnode.service.lifecycle import Stopped

PEER_ID = "QmYyQSo1c1Ym7orWxLYvCrM2EmxFTANf8wXmmE7DWjhx5N"


def resolve(peer: str, timeout_s: float, retry: bool = True) -> str:
    return asyncio.run(resolve_peer(peer, timeout_s, asyncio.Event(), retry=retry))


def test_the_reached_host_and_the_advertised_port_make_the_multiaddr():
    status = {"peer_id": PEER_ID, "maddrs": [f"/ip4/172.18.0.2/tcp/31337/p2p/{PEER_ID}"]}
    assert maddr_from_status(status, "10.0.0.5") == f"/ip4/10.0.0.5/tcp/31337/p2p/{PEER_ID}"
    assert maddr_from_status(status, "::1").startswith("/ip6/::1/tcp/31337/")


@pytest.mark.parametrize(
    "status",
    [
        [],
        {"peer_id": PEER_ID},
        {"peer_id": PEER_ID, "maddrs": ["/ip4/1.2.3.4/udp/5"]},
        {"peer_id": PEER_ID, "maddrs": ["/ip4/1.2.3.4/tcp/99999"]},
        {"peer_id": "not-a-peer-id", "maddrs": ["/ip4/1.2.3.4/tcp/31337"]},
    ],
)
def test_a_bad_status_document_is_refused(status):
    with pytest.raises(HetnodeError):
        maddr_from_status(status, "127.0.0.1")


def test_a_multiaddr_passes_through_and_a_url_is_read_from_the_status_api():
    maddr = f"/ip4/127.0.0.1/tcp/31337/p2p/{PEER_ID}"
    assert not is_url(maddr) and resolve(maddr, 1.0) == maddr
    body = json.dumps({"peer_id": PEER_ID, "maddrs": [f"/ip4/0.0.0.0/tcp/4242/p2p/{PEER_ID}"]}).encode()
    server = HttpServer("127.0.0.1", 0, {"/api/status": lambda: Response(body, "application/json")})
    server.start()
    try:
        assert resolve(f"http://127.0.0.1:{server.port}", 5.0) == f"/ip4/127.0.0.1/tcp/4242/p2p/{PEER_ID}"
    finally:
        server.stop()


def test_an_unreachable_coordinator_url_fails_after_the_timeout():
    server = HttpServer("127.0.0.1", 0, {})
    port = server.start()
    server.stop()  # nothing listens there now
    with pytest.raises(HetnodeError, match="cannot read the coordinator's address") as error:
        resolve(f"http://127.0.0.1:{port}", 0.5)
    assert "connection refused" in str(error.value) and "--connect-timeout" in str(error.value)


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@pytest.mark.parametrize(
    ("route", "reason"),
    [
        (lambda: Response(b"<html>hi</html>", "text/html"), "did not answer JSON"),
        (lambda: Response(b"x" * (MAX_STATUS_BYTES + 10), "application/json"), "more than"),
    ],
)
def test_a_server_that_is_not_a_coordinator_is_refused_at_once(route, reason):
    server = HttpServer("127.0.0.1", 0, {"/api/status": route})
    server.start()
    try:
        started = time.monotonic()
        with pytest.raises(HetnodeError, match=reason):
            resolve(f"http://127.0.0.1:{server.port}", 30.0)
        assert time.monotonic() - started < 5.0  # not retried until the timeout
    finally:
        server.stop()


def test_a_missing_status_api_is_refused_at_once_with_the_fix():
    server = HttpServer("127.0.0.1", 0, {})
    server.start()
    try:
        with pytest.raises(HetnodeError, match="HTTP 404") as error:
            resolve(f"http://127.0.0.1:{server.port}", 30.0)
        assert "--http-port" in str(error.value)
    finally:
        server.stop()


def test_a_server_that_never_answers_fails_within_the_timeout():
    with socket.socket() as silent:  # accepts connections (the backlog), never answers
        silent.bind(("127.0.0.1", 0))
        silent.listen(8)
        started = time.monotonic()
        with pytest.raises(HetnodeError, match="timed out|took too long"):
            resolve(f"http://127.0.0.1:{silent.getsockname()[1]}", 1.5)
        assert time.monotonic() - started < 3.0


def test_a_stop_ends_the_wait_at_once():
    async def stopped_after(seconds: float) -> float:
        stop = asyncio.Event()
        asyncio.get_running_loop().call_later(seconds, stop.set)
        started = time.monotonic()
        with pytest.raises(Stopped):
            await resolve_peer(f"http://127.0.0.1:{free_port()}", 60.0, stop)
        return time.monotonic() - started

    assert asyncio.run(stopped_after(0.5)) < 1.5


def test_a_trickling_answer_is_cut_off_by_the_deadline():
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(1)

        def trickle() -> None:
            conn, _ = listener.accept()
            with conn:
                conn.sendall(b"HTTP/1.0 200 OK\r\nContent-Type: application/json\r\n\r\n")
                for _ in range(40):
                    time.sleep(0.1)
                    try:
                        conn.sendall(b" ")
                    except OSError:
                        return

        threading.Thread(target=trickle, daemon=True).start()
        started = time.monotonic()
        with pytest.raises(HetnodeError, match="timed out|took too long"):
            resolve(f"http://127.0.0.1:{listener.getsockname()[1]}", 1.0, retry=False)
        assert time.monotonic() - started < 2.5


def test_a_p2p_port_given_as_a_url_is_told_apart_at_once():
    with socket.socket() as listener:  # greets like libp2p's multistream-select
        listener.bind(("127.0.0.1", 0))
        listener.listen(1)

        def greet() -> None:
            conn, _ = listener.accept()
            with conn:
                conn.sendall(b"\x13/multistream/1.0.0\n")
                time.sleep(0.5)

        threading.Thread(target=greet, daemon=True).start()
        with pytest.raises(HetnodeError, match="does not speak HTTP") as error:
            resolve(f"http://127.0.0.1:{listener.getsockname()[1]}", 10.0)
    assert "multiaddr" in str(error.value) and "--http-port" in str(error.value)
