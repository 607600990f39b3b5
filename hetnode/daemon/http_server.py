"""A small HTTP server for /metrics, /healthz and the coordinator's status page, on its own thread.

Handlers run on the server's threads, never on the daemon's event loop, so a slow scrape cannot delay a
round; they must only read state that is safe to read from another thread (prometheus-client registries
are; the coordinator hands over immutable snapshots). Only GET and HEAD are served, paths are matched
exactly (the query string is ignored), and a handler that fails answers 500 and logs, without taking the
daemon down.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from hetnode.errors import HetnodeError

log = logging.getLogger(__name__)

DEFAULT_STATUS_PORT = 8400  # the coordinator's status page, API and /metrics


@dataclass(frozen=True)
class Response:
    body: bytes
    content_type: str = "text/plain; charset=utf-8"
    status: int = 200


Route = Callable[[], Response]


class HttpServer:
    """`routes` maps exact paths to handlers; `start()` binds and returns the port (0 picks a free one)."""

    def __init__(self, host: str, port: int, routes: dict[str, Route]) -> None:
        self.host, self.port, self.routes = host, port, dict(routes)
        self._server: ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None

    def start(self) -> int:
        routes = self.routes

        class Handler(BaseHTTPRequestHandler):
            server_version = "hetnode"
            sys_version = ""

            def do_GET(self) -> None:  # noqa: N802 (the stdlib's name)
                self._answer(send_body=True)

            def do_HEAD(self) -> None:  # noqa: N802
                self._answer(send_body=False)

            def _answer(self, send_body: bool) -> None:
                route = routes.get(self.path.split("?", 1)[0])
                if route is None:
                    response = Response(b"not found\n", status=404)
                else:
                    try:
                        response = route()
                    except Exception:
                        log.exception("HTTP handler for %s failed", self.path)
                        response = Response(b"internal error\n", status=500)
                self.send_response(response.status)
                self.send_header("Content-Type", response.content_type)
                self.send_header("Content-Length", str(len(response.body)))
                self.send_header("Cache-Control", "no-store")
                self.send_header("X-Content-Type-Options", "nosniff")
                self.end_headers()
                if send_body:
                    self.wfile.write(response.body)

            def log_message(self, format: str, *args: object) -> None:
                log.debug("%s %s", self.address_string(), format % args)

        try:
            self._server = ThreadingHTTPServer((self.host, self.port), Handler)
        except OSError as exc:
            raise HetnodeError(
                f"cannot serve HTTP on {self.host}:{self.port}: {exc.strerror or exc} "
                "(pick another port, 0 for any free one, or 'off')"
            ) from None
        self._server.daemon_threads = True
        self.port = self._server.server_address[1]
        self._thread = threading.Thread(target=self._server.serve_forever, name="http", daemon=True)
        self._thread.start()
        return self.port

    @property
    def url(self) -> str:
        host = "127.0.0.1" if self.host in ("0.0.0.0", "") else self.host
        return f"http://{host}:{self.port}"

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None
        if self._thread is not None:
            self._thread.join(timeout=5.0)
            self._thread = None
