"""A crowd of slow readers at the coordinator's checkpoint download, and a user's `hetnode export` beside
them: the coordinator's real routes (`CheckpointRoutes`) on its real HTTP server, the user's export as the
CLI runs it, all over sockets on 127.0.0.1. The readers come from other loopback addresses (127.0.0.2…),
as from other machines. Budgets are the coordinator's but for the pace, sized so that the test takes
seconds: a 2 s grace and 4 MiB/s (the coordinator's are 10 s and 256 KiB/s)."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from bootstrap.checkpoint_store import CheckpointRoutes, checkpoints_root, store
from hetnode.cli.main import main
from hetnode.replica.global_model import GlobalModel
from hetnode.service.http_server import HttpServer

RUN = "tiny-0123abcd"


class SlowReader:
    """A download of θ read at about 40 KiB/s from `source`, until the server cuts it or the test ends."""

    def __init__(self, url_port: int, source: str) -> None:
        self.status = b""
        self.answered = threading.Event()
        self._stop = threading.Event()
        self._sock = socket.socket()
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        self._sock.bind((source, 0))
        self._sock.connect(("127.0.0.1", url_port))
        self._sock.sendall(b"GET /api/checkpoint/model.safetensors HTTP/1.0\r\n\r\n")
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        try:
            self.status = self._sock.recv(4096).split(b"\r\n", 1)[0]
            self.answered.set()
            while not self._stop.is_set() and self._sock.recv(4096):
                time.sleep(0.1)
        except OSError:
            pass
        finally:
            self.answered.set()

    def close(self) -> None:
        self._stop.set()
        self._sock.close()


@pytest.fixture
def coordinator(tmp_path: Path, tiny_config) -> Iterator[HttpServer]:
    """The coordinator's checkpoint routes on its HTTP server, with one checkpoint of round 5."""
    model = GlobalModel(tiny_config)
    model.params_round, model.seal_hash = 5, "seal-5"
    store(checkpoints_root(tmp_path / "boot"), model, tiny_config, RUN)
    routes = CheckpointRoutes(checkpoints_root(tmp_path / "boot")).routes()
    server = HttpServer("127.0.0.1", 0, routes, request_timeout_s=2.0, min_stream_rate=4 << 20)
    server.start()
    yield server
    server.stop()


def crowd(server: HttpServer, sources: list[str]) -> list[SlowReader]:
    readers = [SlowReader(server.port, source) for source in sources]
    for reader in readers:
        assert reader.answered.wait(10)
    return readers


def export(server: HttpServer, out: Path) -> tuple[int, float]:
    started = time.monotonic()
    code = main(["export", "--from", server.url, "--timeout", "60", "--out", str(out)])
    return code, time.monotonic() - started


def test_eight_slow_readers_from_one_machine_leave_slots_for_a_user(coordinator, tmp_path):
    """Eight downloads from one address get two slots; a user elsewhere exports at once."""
    readers = crowd(coordinator, ["127.0.0.2"] * 8)
    try:
        statuses = sorted(r.status for r in readers)
        assert statuses.count(b"HTTP/1.0 200 OK") == 2, statuses
        assert coordinator.stats().busy_clients == 6
        code, took = export(coordinator, tmp_path / "hf")
        assert code == 0 and took < 10
        assert coordinator.stats().busy_streams == 0  # the user was never told to come back
    finally:
        for reader in readers:
            reader.close()


def test_eight_slow_readers_from_four_machines_lose_their_slots_to_the_pace(coordinator, tmp_path):
    """Two readers from each of four addresses hold every slot; the user is told 503 and asks again with
    backoff; the slow readers are cut a few seconds after the grace, and the user's export goes through."""
    readers = crowd(coordinator, [f"127.0.0.{2 + i % 4}" for i in range(8)])
    try:
        statuses = sorted(r.status for r in readers)
        assert statuses.count(b"HTTP/1.0 200 OK") == 4, statuses
        assert coordinator.stats().busy_streams == 4
        code, took = export(coordinator, tmp_path / "hf")
        assert code == 0 and took < 30
        stats = coordinator.stats()
        assert stats.slow_streams == 4 and stats.busy_streams > 4  # the user was refused, then got in
    finally:
        for reader in readers:
            reader.close()
