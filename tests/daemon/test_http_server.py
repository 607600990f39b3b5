"""The HTTP server under hostile clients, over real sockets: idle floods, slowloris, oversized requests,
a full house of slow handlers, and a stop() that does not wait for the stragglers."""

from __future__ import annotations

import contextlib
import socket
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator

import pytest

from hetnode.service.http_server import MAX_CONNECTIONS, HttpServer, Response


def wait_until(condition: Callable[[], bool], timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError("condition not met in time")
        time.sleep(0.01)


def get(server: HttpServer, path: str = "/ok", timeout: float = 5.0) -> bytes:
    with urllib.request.urlopen(f"{server.url}{path}", timeout=timeout) as response:
        return response.read()


def closed_by_server(sock: socket.socket, timeout: float) -> bool:
    """True once the server hangs up (EOF or reset) within `timeout`; answers it sent are skipped."""
    sock.settimeout(timeout)
    try:
        while sock.recv(4096):
            pass
    except (ConnectionResetError, BrokenPipeError):
        return True
    except TimeoutError:
        return False
    return True


@pytest.fixture
def serve() -> Iterator[Callable[..., HttpServer]]:
    servers: list[HttpServer] = []

    def start(routes: dict | None = None, **budgets) -> HttpServer:
        server = HttpServer("127.0.0.1", 0, routes or {"/ok": lambda: Response(b"ok\n")}, **budgets)
        server.start()
        servers.append(server)
        return server

    yield start
    for server in servers:
        server.stop()


def test_idle_half_open_connections_do_not_lock_out_a_scrape(serve):
    baseline = threading.active_count()
    server = serve()  # the defaults: 64 connections, 10 s to send a request
    idle = []
    try:
        for i in range(200):
            sock = socket.create_connection(("127.0.0.1", server.port), timeout=5)
            if i % 2:
                sock.sendall(b"GET /ok HTTP/1.1\r\nHost: x\r\n")  # half a request, never finished
            idle.append(sock)
        wait_until(lambda: server.stats().evicted == 200 - MAX_CONNECTIONS)
        started = time.monotonic()
        assert get(server) == b"ok\n"
        assert time.monotonic() - started < 3.0
        stats = server.stats()
        assert stats.active <= MAX_CONNECTIONS and stats.served == 1 and stats.refused == 0
        # one thread per admitted connection, plus the accept loop; evicted ones have ended
        wait_until(lambda: threading.active_count() <= baseline + MAX_CONNECTIONS + 1)
    finally:
        for sock in idle:
            sock.close()


def test_a_slowloris_client_is_dropped_after_the_timeout(serve):
    server = serve(request_timeout_s=1.0)
    sock = socket.create_connection(("127.0.0.1", server.port), timeout=5)
    try:
        started = time.monotonic()
        sock.sendall(b"GET /ok HTTP/1.1\r\n")
        dropped = False
        while time.monotonic() - started < 5.0:  # a header byte every 0.1 s: progress, never an end
            try:
                sock.sendall(b"X")
            except OSError:
                dropped = True
                break
            sock.settimeout(0.1)
            try:
                if sock.recv(4096) == b"":
                    dropped = True
                    break
            except TimeoutError:
                continue
            except OSError:
                dropped = True
                break
        elapsed = time.monotonic() - started
        assert dropped and 0.9 <= elapsed < 2.5
        wait_until(lambda: server.stats().timed_out == 1 and server.stats().active == 0)
        assert get(server) == b"ok\n"
    finally:
        sock.close()


def test_an_idle_connection_is_closed_after_the_timeout(serve):
    server = serve(request_timeout_s=0.5)
    sock = socket.create_connection(("127.0.0.1", server.port), timeout=5)
    try:
        started = time.monotonic()
        assert closed_by_server(sock, timeout=3.0)
        assert time.monotonic() - started < 2.0
    finally:
        sock.close()


def test_past_the_cap_with_every_handler_busy_a_new_connection_is_closed_at_once(serve):
    release = threading.Event()

    def slow() -> Response:
        release.wait(10)
        return Response(b"slow\n")

    server = serve({"/slow": slow, "/ok": lambda: Response(b"ok\n")}, max_connections=2)
    answers: list[bytes] = []
    busy = [threading.Thread(target=lambda: answers.append(get(server, "/slow", 10))) for _ in range(2)]
    for thread in busy:
        thread.start()
    try:
        wait_until(lambda: server.stats().served == 2)
        threads_before = threading.active_count()
        sock = socket.create_connection(("127.0.0.1", server.port), timeout=5)
        try:
            sock.sendall(b"GET /ok HTTP/1.0\r\n\r\n")
            started = time.monotonic()
            assert closed_by_server(sock, timeout=2.0)
            assert time.monotonic() - started < 1.0
        finally:
            sock.close()
        assert server.stats().refused == 1
        assert threading.active_count() == threads_before  # no thread was started for it
    finally:
        release.set()
        for thread in busy:
            thread.join(10)
    assert answers == [b"slow\n", b"slow\n"]
    wait_until(lambda: server.stats().active == 0)  # a client reads its answer before the slot is freed
    assert get(server) == b"ok\n"  # slots are free again


def test_an_oversized_request_is_dropped_and_the_server_keeps_serving(serve):
    server = serve(max_request_bytes=4096)
    sock = socket.create_connection(("127.0.0.1", server.port), timeout=5)
    try:
        with contextlib.suppress(OSError):  # the server may hang up before all of it is sent
            sock.sendall(b"GET /ok HTTP/1.0\r\n" + b"X-Pad: " + b"a" * 8000 + b"\r\n\r\n")
        assert closed_by_server(sock, timeout=3.0)
    finally:
        sock.close()
    wait_until(lambda: server.stats().too_large == 1)
    assert get(server) == b"ok\n"
    assert get(server, "/ok?" + "q" * 1000) == b"ok\n"  # ordinary sizes still pass


def test_stop_does_not_wait_for_idle_connections(serve):
    server = serve()
    socks = [socket.create_connection(("127.0.0.1", server.port), timeout=5) for _ in range(5)]
    try:
        wait_until(lambda: server.stats().active == 5)
        started = time.monotonic()
        server.stop()
        assert time.monotonic() - started < 2.0
        assert all(closed_by_server(sock, timeout=2.0) for sock in socks)
    finally:
        for sock in socks:
            sock.close()


def test_budgets_are_checked():
    for bad in ({"max_connections": 0}, {"request_timeout_s": 0}, {"max_request_bytes": 10}):
        with pytest.raises(ValueError, match=next(iter(bad))):
            HttpServer("127.0.0.1", 0, {}, **bad)
