"""File answers of the HTTP server (`FileResponse`, e.g. a checkpoint): streamed with Content-Length, at most
`max_streams` at once and `max_streams_per_client` for one address (a 503 past either, at once), and a client
that stops reading, or reads below the minimum rate, lets go of its slot in bounded time."""

from __future__ import annotations

import os
import socket
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from hetnode.service.http_server import FileResponse, HttpServer
from hetnode.service.stream_slots import client_key

SIZE = 32 << 20  # larger than any loopback socket buffer: a client that stops reading blocks the server


def file_route(path: Path):
    def route() -> FileResponse:
        file = open(path, "rb")  # noqa: SIM115 - the server closes it
        return FileResponse(file, os.fstat(file.fileno()).st_size, headers=(("X-Test", "1"),))

    return route


def test_a_file_is_streamed_and_a_stalled_download_lets_go_of_its_slot(tmp_path):
    path = tmp_path / "big.bin"
    path.write_bytes(os.urandom(1 << 20) * (SIZE >> 20))
    server = HttpServer(
        "127.0.0.1", 0, {"/f": file_route(path)}, request_timeout_s=1.0, max_streams=1, min_stream_rate=1e12
    )
    server.start()
    try:
        head = urllib.request.Request(f"{server.url}/f", method="HEAD")
        with urllib.request.urlopen(head, timeout=10) as response:
            assert int(response.headers["Content-Length"]) == SIZE and response.read() == b""

        stalled = socket.socket()
        stalled.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        stalled.connect(("127.0.0.1", server.port))
        stalled.sendall(b"GET /f HTTP/1.0\r\n\r\n")
        assert stalled.recv(4096).startswith(b"HTTP/1.0 200")  # then it reads no more
        try:  # the one stream slot is taken: a second download is told to come back, at once
            urllib.request.urlopen(f"{server.url}/f", timeout=5)
            raise AssertionError("expected 503")
        except urllib.error.HTTPError as busy:
            assert busy.code == 503 and busy.headers["Retry-After"] == "30"
        assert server.stats().busy_streams == 1

        deadline = time.monotonic() + 15  # cut off within its deadline (1 s here), then the slot is free
        while True:
            try:
                with urllib.request.urlopen(f"{server.url}/f", timeout=10) as response:
                    assert response.headers["X-Test"] == "1"
                    assert len(response.read()) == SIZE
                break
            except urllib.error.HTTPError as busy:
                assert busy.code == 503 and time.monotonic() < deadline
                time.sleep(0.2)
        stalled.close()
    finally:
        server.stop()


def start_download(server: HttpServer, source: str, rcvbuf: int = 4096) -> socket.socket:
    """A client at `source` (127.0.0.x: another address on this machine) that asks for /f and reads the
    status line; then it reads only what the test makes it read."""
    client = socket.socket()
    client.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    client.bind((source, 0))
    client.connect(("127.0.0.1", server.port))
    client.sendall(b"GET /f HTTP/1.0\r\n\r\n")
    return client


def test_one_address_holds_at_most_its_share_of_the_download_slots(tmp_path):
    path = tmp_path / "big.bin"
    path.write_bytes(os.urandom(1 << 20) * (SIZE >> 20))
    server = HttpServer("127.0.0.1", 0, {"/f": file_route(path)}, max_streams=4, min_stream_rate=1.0)
    server.start()
    try:
        crowd = [start_download(server, "127.0.0.2") for _ in range(3)]
        heads = [c.recv(4096) for c in crowd]
        assert [h.split(b"\r\n", 1)[0] for h in heads].count(b"HTTP/1.0 200 OK") == 2
        refused = next(c for c, h in zip(crowd, heads, strict=True) if h.startswith(b"HTTP/1.0 503"))
        while chunk := refused.recv(4096):  # the rest of the 503: its JSON body, then the server closes
            heads.append(chunk)
        assert b"too many downloads from your address at once" in b"".join(heads)
        assert server.stats().busy_clients == 1 and server.stats().busy_streams == 0
        with urllib.request.urlopen(f"{server.url}/f", timeout=10) as response:  # another address: in
            assert len(response.read()) == SIZE
        for client in crowd:
            client.close()
    finally:
        server.stop()


def test_a_reader_below_the_rate_is_cut_as_it_goes(tmp_path):
    """400 KiB/s against a 4 MiB/s minimum: each write drains well within the stall timeout, so only the
    pace cuts it, a second or so after the 2 s grace (the whole 64 MiB would have been due at 18 s)."""
    path = tmp_path / "big.bin"
    path.write_bytes(os.urandom(1 << 20) * 64)
    server = HttpServer(
        "127.0.0.1", 0, {"/f": file_route(path)}, request_timeout_s=2.0, min_stream_rate=4 << 20
    )
    server.start()
    reader = start_download(server, "127.0.0.2", rcvbuf=65536)
    started, stop = time.monotonic(), threading.Event()

    def trickle() -> None:
        while not stop.is_set() and reader.recv(40960):
            time.sleep(0.1)

    thread = threading.Thread(target=trickle, daemon=True)
    thread.start()
    try:
        while server.stats().slow_streams == 0:
            assert time.monotonic() - started < 8, "the slow reader kept its slot"
            time.sleep(0.05)
        assert time.monotonic() - started > 1.5  # the grace is given
    finally:
        stop.set()
        reader.close()
        server.stop()


@pytest.mark.parametrize(
    ("host", "key"),
    [
        ("203.0.113.7", "203.0.113.7"),
        ("2001:db8:1:2:aaaa::1", "2001:db8:1:2::/64"),
        ("2001:db8:1:2:bbbb::9%eth0", "2001:db8:1:2::/64"),  # another address of the same subscriber
        ("::ffff:203.0.113.7", "203.0.113.7"),
    ],
)
def test_a_client_is_its_ipv4_address_or_its_ipv6_slash_64(host: str, key: str):
    assert client_key(host) == key
