"""File answers of the HTTP server (`FileResponse`, e.g. a checkpoint): streamed with Content-Length, at most
`max_streams` at once (a 503 past that, at once), and a client that stops reading lets go of its slot in
bounded time."""

from __future__ import annotations

import os
import socket
import time
import urllib.error
import urllib.request
from pathlib import Path

from hetnode.service.http_server import FileResponse, HttpServer

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
