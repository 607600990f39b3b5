"""A small HTTP server for /metrics, /healthz and the coordinator's status page, on its own threads.

Handlers run on the server's threads, never on the daemon's event loop, so a slow scrape cannot delay a
round; they must only read state that is safe to read from another thread (prometheus-client registries
are; the coordinator hands over immutable snapshots). Only GET and HEAD are served, paths are matched
exactly (the query string is ignored), and a handler that fails answers 500 and logs, without taking the
daemon down.

Clients are strangers (docs/security.md, "Exhaust a daemon"), so every connection is budgeted:
- at most `max_connections` at a time, each on its own thread. Past the cap, the oldest connection that
  is still sending its request is dropped to make room (idle sockets are then worth nothing to an
  attacker, and a scrape still gets in); when every connection is busy answering, the new one is closed
  at once, on the accepting thread, without a thread of its own. Both are counted and logged at most
  once a minute;
- the whole request (line and headers) must arrive within `request_timeout_s` and `max_request_bytes`,
  one deadline for all reads, so a client trickling a byte at a time (slowloris) is dropped on time;
- each write of the answer is bounded by `request_timeout_s` too (`sendall` keeps one deadline);
- a file answer (`FileResponse`, e.g. a checkpoint of gigabytes) is streamed from its open file in chunks
  of `STREAM_CHUNK` bytes (memory stays bounded whatever the file's size), each write bounded as above and
  paced as it goes: byte n must be handed over within `request_timeout_s + n / min_stream_rate`, so a
  client reading below the rate is cut off seconds after that grace, whatever the file's size. At most
  `max_streams` file answers run at once, at most `max_streams_per_client` of them for one client address
  (`stream_slots.py`); past either a client gets 503 and Retry-After at once, so downloads never take the
  connections that the status page and /metrics need, and one machine's crowd of slow readers never takes
  every download slot.
Connections serve one request (HTTP/1.0, no keep-alive).
"""

from __future__ import annotations

import contextlib
import errno
import io
import logging
import socket
import sys
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, BinaryIO

from hetnode.errors import ConfigError, HetnodeError
from hetnode.service.stream_slots import Refusal, StreamSlots, due_by

log = logging.getLogger(__name__)

DEFAULT_STATUS_PORT = 8400  # the coordinator's status page, API and /metrics
MAX_CONNECTIONS = 64  # threads, sockets and (on the coordinator) waiters for a ledger connection
REQUEST_TIMEOUT_S = 10.0  # a scraper or browser on any real link sends its request in well under a second
MAX_REQUEST_BYTES = 64 * 1024  # request line + headers; the stdlib alone allows 100 headers of 64 KiB
LISTEN_BACKLOG = 128  # the stdlib's 5 drops SYNs when many clients connect at once
LOG_INTERVAL_S = 60.0  # refusals are logged at most this often
MAX_STREAMS = 4  # file answers at once: a few downloads of θ, never the whole connection budget
MAX_STREAMS_PER_CLIENT = 2  # of those, for one client address: one machine never holds them all
MIN_STREAM_RATE = 256 * 1024  # bytes/s a file answer must keep up as it goes (2 Mbit/s: a 4 GB θ in ~4.5 h)
RETRY_AFTER_S = "30"  # advice to other clients; hetnode export asks again sooner, with backoff
STREAM_CHUNK = 256 * 1024  # bytes read and written at a time: the memory one stream holds
Headers = tuple[tuple[str, str], ...]


@dataclass(frozen=True)
class Response:
    body: bytes
    content_type: str = "text/plain; charset=utf-8"
    status: int = 200
    headers: Headers = ()  # more headers (the server's own come first)


@dataclass(frozen=True)
class FileResponse:
    """`length` bytes of an open binary file, streamed (the server closes it). The route opens the file,
    so the answer is that file even if a writer replaces or deletes its path meanwhile (POSIX)."""

    file: BinaryIO
    length: int
    content_type: str = "application/octet-stream"
    headers: Headers = ()


Route = Callable[[], Response | FileResponse]


@dataclass(frozen=True)
class HttpStats:
    """Counters since `start()`; `active` is the connections open now."""

    active: int = 0
    served: int = 0
    refused: int = 0  # closed at once: every connection was busy answering
    evicted: int = 0  # still sending its request when the cap was reached, dropped for a newer one
    timed_out: int = 0  # request not complete within request_timeout_s
    too_large: int = 0  # request line + headers over max_request_bytes
    busy_streams: int = 0  # file answers refused with 503: max_streams were running
    busy_clients: int = 0  # file answers refused with 503: the client's address held its share already
    slow_streams: int = 0  # file answers cut off: the client fell behind min_stream_rate


class RequestTooLarge(HetnodeError):
    """The request line and headers exceeded the server's byte budget."""


class _RequestReader(io.RawIOBase):
    """Reads a request from `sock` against one deadline and one byte budget, whatever the reads' sizes."""

    def __init__(self, sock: socket.socket, deadline: float, budget: int, on_timeout: Callable[[], None]):
        super().__init__()
        self._sock, self._deadline, self._budget, self._on_timeout = sock, deadline, budget, on_timeout

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        remaining = self._deadline - time.monotonic()
        try:
            if remaining <= 0:
                raise TimeoutError("request not received in time")
            if self._budget <= 0:
                raise RequestTooLarge("request line and headers too large")
            self._sock.settimeout(remaining)
            n = self._sock.recv_into(memoryview(buffer)[: self._budget])
        except TimeoutError:
            self._on_timeout()
            raise
        self._budget -= n
        return n


class _Handler(BaseHTTPRequestHandler):
    server_version = "hetnode"
    sys_version = ""
    server: _Server  # narrower than the stdlib's BaseServer

    def setup(self) -> None:
        server = self.server
        self.timeout = server.request_timeout_s  # StreamRequestHandler.setup applies it to the socket
        super().setup()
        self.rfile.close()  # replaced by a reader with one deadline for the whole request
        reader = _RequestReader(
            self.connection,
            time.monotonic() + server.request_timeout_s,
            server.max_request_bytes,
            server.count_timeout,
        )
        self.rfile = io.BufferedReader(reader)

    def do_GET(self) -> None:  # noqa: N802 (the stdlib's name)
        self._answer(send_body=True)

    def do_HEAD(self) -> None:  # noqa: N802
        self._answer(send_body=False)

    def _answer(self, send_body: bool) -> None:
        self.close_connection = True
        if not self.server.begin_answer(self.request):
            return  # dropped for a newer connection while its request was still arriving
        self.connection.settimeout(self.server.request_timeout_s)  # for the writes below
        route = self.server.routes.get(self.path.split("?", 1)[0])
        if route is None:
            response: Response | FileResponse = Response(b"not found\n", status=404)
        else:
            try:
                response = route()
            except Exception:
                log.exception("HTTP handler for %s failed", self.path[:200])
                response = Response(b"internal error\n", status=500)
        if isinstance(response, FileResponse):
            self._answer_file(response, send_body)
            return
        self._head(response.status, response.content_type, len(response.body), response.headers)
        if send_body:
            self.wfile.write(response.body)

    def _head(self, status: int, content_type: str, length: int, headers: Headers) -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(length))
        self.send_header("Cache-Control", "no-store")
        self.send_header("X-Content-Type-Options", "nosniff")
        for name, value in headers:
            self.send_header(name, value)
        self.end_headers()

    def _answer_file(self, response: FileResponse, send_body: bool) -> None:
        with response.file:
            if not send_body:  # HEAD: the size, without a stream
                self._head(200, response.content_type, response.length, response.headers)
                return
            client = self.client_address[0]
            refusal = self.server.begin_stream(client)
            if refusal is not None:
                busy = b'{"error": "%s; retry later"}\n' % refusal.value.encode()
                self._head(503, "application/json", len(busy), (("Retry-After", RETRY_AFTER_S),))
                self.wfile.write(busy)
                return
            try:
                self._head(200, response.content_type, response.length, response.headers)
                self._stream(response.file, response.length)
            finally:
                self.server.end_stream(client)

    def _stream(self, file: BinaryIO, length: int) -> None:
        timeout, rate = self.server.request_timeout_s, self.server.min_stream_rate
        started, sent = time.monotonic(), 0
        while sent < length:
            chunk = file.read(min(STREAM_CHUNK, length - sent))
            if not chunk:  # the file is shorter than it said: the client sees a short body (Content-Length)
                log.warning("HTTP %s: the file ended %d bytes early", self.path[:200], length - sent)
                return
            # the grace is the request timeout: connection set-up and TCP slow start, then the pace
            remaining = due_by(started, timeout, rate, sent + len(chunk)) - time.monotonic()
            if remaining <= 0:
                self.server.count_slow_stream()
                raise TimeoutError("the client read the file too slowly")
            self.connection.settimeout(min(timeout, remaining))
            try:
                self.wfile.write(chunk)
            except TimeoutError:
                self.server.count_slow_stream()
                raise
            sent += len(chunk)

    def log_message(self, format: str, *args: object) -> None:
        log.debug("%s %s", self.address_string(), format % args)


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    block_on_close = False  # stop() ends the connections itself rather than waiting on their threads
    request_queue_size = LISTEN_BACKLOG

    def __init__(
        self,
        address: tuple[str, int],
        routes: dict[str, Route],
        max_connections: int,
        request_timeout_s: float,
        max_request_bytes: int,
        max_streams: int = MAX_STREAMS,
        min_stream_rate: float = MIN_STREAM_RATE,
        max_streams_per_client: int = MAX_STREAMS_PER_CLIENT,
    ) -> None:
        self.routes = routes
        self.max_connections = max_connections
        self.request_timeout_s = request_timeout_s
        self.max_request_bytes = max_request_bytes
        self.min_stream_rate = min_stream_rate
        self.slots = StreamSlots(max_streams, max_streams_per_client)
        self._lock = threading.Lock()
        self._arriving: OrderedDict[socket.socket, None] = OrderedDict()  # oldest first
        self._answering: set[socket.socket] = set()
        counters = ("served", "refused", "evicted", "timed_out", "too_large")
        counters += ("busy_streams", "busy_clients", "slow_streams")
        self._counts = dict.fromkeys(counters, 0)
        self._logged_at = -LOG_INTERVAL_S
        super().__init__(address, _Handler)

    def process_request(self, request: Any, client_address: Any) -> None:
        """On the accepting thread: admit the connection (dropping an arriving one if need be) or close it."""
        victim = None
        with self._lock:
            full = len(self._arriving) + len(self._answering) >= self.max_connections
            if full and self._arriving:
                victim, _ = self._arriving.popitem(last=False)
                self._counts["evicted"] += 1
            elif full:
                self._counts["refused"] += 1
            if not full or victim is not None:
                self._arriving[request] = None
        if full:
            self._log_full()
        if victim is not None:
            _hang_up(victim)  # its thread's read returns at once; that thread closes the socket
        elif full:
            self.shutdown_request(request)
            return
        try:
            super().process_request(request, client_address)
        except BaseException:  # no thread (e.g. the OS refused one): free the slot; the caller closes it
            with self._lock:
                self._arriving.pop(request, None)
            raise

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            with self._lock:
                self._arriving.pop(request, None)
                self._answering.discard(request)

    def begin_answer(self, request: socket.socket) -> bool:
        """The request is in: the connection no longer counts as evictable. False if it was evicted."""
        with self._lock:
            if request not in self._arriving:
                return False
            del self._arriving[request]
            self._answering.add(request)
            self._counts["served"] += 1
            return True

    def count_timeout(self) -> None:
        with self._lock:
            self._counts["timed_out"] += 1

    def begin_stream(self, client: str) -> Refusal | None:
        """Take a download slot for `client`; why not (counted) when its share or all slots are taken."""
        refusal = self.slots.take(client)
        if refusal is not None:
            with self._lock:
                self._counts["busy_clients" if refusal is Refusal.CLIENT else "busy_streams"] += 1
        return refusal

    def end_stream(self, client: str) -> None:
        self.slots.give_back(client)

    def count_slow_stream(self) -> None:
        with self._lock:
            self._counts["slow_streams"] += 1

    def handle_error(self, request: Any, client_address: Any) -> None:
        """Clients that hang up, time out or send too much are routine: no traceback on stderr."""
        exc = sys.exc_info()[1]
        if isinstance(exc, RequestTooLarge):
            with self._lock:
                self._counts["too_large"] += 1
            log.debug("HTTP request from %s too large", client_address)
        elif isinstance(exc, OSError):
            log.debug("HTTP connection from %s failed: %s", client_address, exc)
        else:
            log.error("HTTP connection from %s failed", client_address, exc_info=exc)

    def stats(self) -> HttpStats:
        with self._lock:
            return HttpStats(active=len(self._arriving) + len(self._answering), **self._counts)

    def hang_up_all(self) -> None:
        with self._lock:
            connections = [*self._arriving, *self._answering]
        for request in connections:
            _hang_up(request)

    def _log_full(self) -> None:
        now = time.monotonic()
        with self._lock:
            if now - self._logged_at < LOG_INTERVAL_S:
                return
            self._logged_at = now
            counts = dict(self._counts)
        log.warning(
            "HTTP connection cap %d reached on port %d: %d connections refused, %d dropped so far",
            self.max_connections,
            self.server_address[1],
            counts["refused"],
            counts["evicted"],
        )


def bind_problem(host: str, port: int, exc: OSError, flag: str | None) -> HetnodeError:
    """Why `host:port` cannot be served. With the `flag` that chose the port, an argument error (exit 2:
    restarting will not free the port) that says which flag to change; without, a plain error."""
    where = f"cannot serve HTTP on {host}:{port}"
    if flag is None:
        return HetnodeError(
            f"{where}: {exc.strerror or exc} (pick another port, 0 for any free one, or 'off')"
        )
    why = f"port {port} is taken" if exc.errno == errno.EADDRINUSE else (exc.strerror or str(exc))
    return ConfigError(
        flag,
        flag.lstrip("-"),
        f"{where}: {why}: pass {flag} N for another port (0: any free one), or {flag} off",
    )


def refuse_taken_port(host: str, port: int | None, flag: str) -> None:
    """Fail at once, before a daemon starts anything, when `port` (chosen by `flag`) cannot be bound; the
    server's own bind later still reports a port taken in between."""
    if not port:  # off, or any free port
        return
    try:
        with socket.create_server((host, port), family=_family(host)):  # SO_REUSEADDR, as the server binds
            pass
    except OSError as exc:
        raise bind_problem(host, port, exc, flag) from None


def _family(host: str) -> socket.AddressFamily:
    return socket.AF_INET6 if ":" in host else socket.AF_INET


def _hang_up(request: socket.socket) -> None:
    """Shut a socket down (not close: its thread still owns the descriptor) so that blocked reads return."""
    with contextlib.suppress(OSError):  # already gone
        request.shutdown(socket.SHUT_RDWR)


class HttpServer:
    """`routes` maps exact paths to handlers; `start()` binds and returns the port (0 picks a free one).

    The budgets (module docstring) are keyword arguments with defaults for the status page and /metrics.
    `flag`: the command line flag that chose the port (e.g. "--http-port"); a port that cannot be bound
    is then an argument error that names it.
    """

    def __init__(
        self,
        host: str,
        port: int,
        routes: dict[str, Route],
        *,
        flag: str | None = None,
        max_connections: int = MAX_CONNECTIONS,
        request_timeout_s: float = REQUEST_TIMEOUT_S,
        max_request_bytes: int = MAX_REQUEST_BYTES,
        max_streams: int = MAX_STREAMS,
        min_stream_rate: float = MIN_STREAM_RATE,
        max_streams_per_client: int = MAX_STREAMS_PER_CLIENT,
    ) -> None:
        if max_connections < 1:
            raise ValueError(f"max_connections must be at least 1, got {max_connections}")
        if not request_timeout_s > 0:
            raise ValueError(f"request_timeout_s must be positive, got {request_timeout_s}")
        if max_request_bytes < 1024:
            raise ValueError(f"max_request_bytes must be at least 1024, got {max_request_bytes}")
        if max_streams < 1:  # above max_connections it is never reached: connections bound streams too
            raise ValueError(f"max_streams must be at least 1, got {max_streams}")
        if not min_stream_rate > 0:
            raise ValueError(f"min_stream_rate must be positive, got {min_stream_rate}")
        if max_streams_per_client < 1:
            raise ValueError(f"max_streams_per_client must be at least 1, got {max_streams_per_client}")
        self.host, self.port, self.routes = host, port, dict(routes)
        self.flag = flag  # the command line flag that chose the port, named when it is taken
        self.max_connections = max_connections
        self.request_timeout_s = request_timeout_s
        self.max_request_bytes = max_request_bytes
        self.max_streams = max_streams
        self.min_stream_rate = min_stream_rate
        self.max_streams_per_client = max_streams_per_client
        self._server: _Server | None = None
        self._thread: threading.Thread | None = None
        self._final = HttpStats()  # what stats() answers once stopped

    def start(self) -> int:
        try:
            self._server = _Server(
                (self.host, self.port),
                self.routes,
                self.max_connections,
                self.request_timeout_s,
                self.max_request_bytes,
                self.max_streams,
                self.min_stream_rate,
                self.max_streams_per_client,
            )
        except OSError as exc:
            raise bind_problem(self.host, self.port, exc, self.flag) from None
        self.port = self._server.server_address[1]
        self._thread = threading.Thread(target=self._server.serve_forever, name="http", daemon=True)
        self._thread.start()
        return self.port

    @property
    def url(self) -> str:
        host = "127.0.0.1" if self.host in ("0.0.0.0", "") else self.host
        return f"http://{host}:{self.port}"

    def stats(self) -> HttpStats:
        """Connection counters (zero before `start()`, the last ones after `stop()`), e.g. for metrics."""
        return self._server.stats() if self._server is not None else self._final

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()  # no new connections
            self._server.hang_up_all()  # open ones end now rather than at their timeout
            self._server.server_close()
            self._final = self._server.stats()
            self._server = None
        if self._thread is not None:
            self._thread.join(timeout=5.0)
            self._thread = None
