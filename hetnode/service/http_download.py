"""One GET of a stranger's answer into a file: the bounded HTTP client of every download from a coordinator
(`hetnode export --from` and `hetnode sample --from`, through `hetnode/export/download.py`; a joining peer's
copy of the run's tokenizer, `hetnode/daemon/run_tokenizer.py`).

The coordinator at the URL may be anyone's, so its answer is data under budgets the caller sets:
- **bytes**: a declared `Content-Length` over the limit is refused before anything is read or written, and a
  body is never read past the limit whatever it declares;
- **time**: one deadline for the whole download, every request and retry included. A watchdog hangs the
  socket up when it passes, so a server that drips a byte at a time, in its headers or its body, cannot keep
  us past it; a read that stalls gives up after `READ_TIMEOUT_S` on its own;
- **no redirects**: a 3xx is an error, never a request to a host the user did not name;
- **text**: whatever the server says back (reason, `{"error": …}`) is cut to one printable line.

Each failure is one of two kinds. An answer that no retry will mend (over a limit, a malformed
`Content-Length` or HTTP head, a redirect, any status but 200, 5xx and the 4xx in `MAY_PASS`) is a
RefusedAnswer (the CLI exits 2). What may pass (cannot reach, the deadline, a stall, a reset, an answer cut
short, 404, 5xx) is a plain CheckpointError (exit 1).

A 503 (the coordinator is rewriting checkpoints, or every download slot is taken) is asked again with
exponential backoff and jitter for up to `BUSY_SPAN_S`, within the deadline.
"""

from __future__ import annotations

import contextlib
import http.client
import json
import random
import socket
import threading
import time
import urllib.parse
from dataclasses import dataclass
from pathlib import Path

from hetnode.errors import CheckpointError, RefusedAnswer

READ_TIMEOUT_S = 30.0  # one read that brings nothing for this long has stalled
CHUNK = 1 << 20
BUSY_SPAN_S = 30.0  # how long a 503 is asked again: slow downloads are cut within seconds server-side
FIRST_BACKOFF_S = 0.25
MAX_BACKOFF_S = 4.0
MAX_ERROR_TEXT = 300  # characters of a server's own words that reach the user's terminal
ERROR_BODY_BYTES = 4096
NOTHING_HERE = "nothing here"  # what a bare 404 says, unless the caller knows better
MAY_PASS = frozenset({404, 408, 425, 429})  # the 4xx that asking later may mend; every 5xx may too


class Busy(CheckpointError):
    """HTTP 503: the coordinator is rewriting its checkpoints or serving its limit of downloads."""


@dataclass(frozen=True)
class Budget:
    """What one download may cost: `deadline` (time.monotonic()) for everything, given as `timeout_s`, and
    `max_bytes` written to disk for all its files. `deadline_name` names the deadline in its user's words (the
    flag that set it, "--timeout"), for the error that says it passed."""

    deadline: float
    timeout_s: float
    max_bytes: int
    deadline_name: str = "the time allowed,"

    @classmethod
    def starting_now(
        cls, timeout_s: float, max_bytes: int, deadline_name: str = "the time allowed,"
    ) -> Budget:
        return cls(time.monotonic() + timeout_s, timeout_s, max_bytes, deadline_name)

    def left(self, url: str) -> float:
        """Seconds left; CheckpointError once the deadline has passed."""
        left = self.deadline - time.monotonic()
        if left <= 0:
            raise self.expired(url)
        return left

    def expired(self, url: str) -> CheckpointError:
        return CheckpointError(f"{url}: not done within {self.deadline_name} {self.timeout_s:g} s")


def one_line(text: str, limit: int = 500) -> str:
    """`text` as one line of printable characters at most `limit` long: remote text must not move the
    cursor, colour the terminal or pose as another message."""
    flat = "".join(c if c.isprintable() else " " for c in text)
    flat = " ".join(flat.split())
    return flat if len(flat) <= limit else flat[: limit - 1] + "…"


def get_retrying(url: str, dest: Path, limit: int, budget: Budget, missing: str = NOTHING_HERE) -> None:
    """`get`, asking again on 503 with exponential backoff and jitter for up to `BUSY_SPAN_S`."""
    give_up = time.monotonic() + BUSY_SPAN_S
    backoff = FIRST_BACKOFF_S
    while True:
        try:
            get(url, dest, limit, budget, missing)
            return
        except Busy:
            pause = backoff * random.uniform(0.5, 1.0)  # jitter: a crowd turned away does not return as one
            if time.monotonic() + pause > min(give_up, budget.deadline):
                raise
            time.sleep(pause)
            backoff = min(2 * backoff, MAX_BACKOFF_S)


def get(url: str, dest: Path, limit: int, budget: Budget, missing: str = NOTHING_HERE) -> None:
    """GET `url` into `dest`: at most `limit` bytes, within `budget`'s deadline. CheckpointError (Busy for
    a 503, RefusedAnswer for what no retry mends) for anything but a whole 200 answer; `missing` says what
    a bare 404 means."""
    parts = urllib.parse.urlsplit(url)
    kind = http.client.HTTPSConnection if parts.scheme == "https" else http.client.HTTPConnection
    connection = kind(parts.hostname or "", parts.port, timeout=min(READ_TIMEOUT_S, budget.left(url)))
    watchdog = _Watchdog(connection, budget.deadline)
    try:
        connection.request("GET", parts.path, headers={"Accept": "*/*", "User-Agent": "hetnode"})
        reply = connection.getresponse()
        if reply.status != 200:
            raise _refusal(url, reply, missing)
        declared = _declared_length(url, reply)
        if declared is not None and declared > limit:
            raise RefusedAnswer(f"{url}: answer of {declared:,} bytes, more than the {limit:,} allowed")
        size = _copy(url, reply, dest, limit, budget)
        if declared is not None and size != declared:  # http.client reads a short body as the end
            raise CheckpointError(f"{url}: answer cut short ({size:,} of {declared:,} bytes)")
    except (OSError, http.client.HTTPException) as exc:  # resets, stalls, answers cut short or malformed
        if watchdog.fired or time.monotonic() >= budget.deadline:
            raise budget.expired(url) from None
        if isinstance(exc, ConnectionRefusedError | socket.gaierror):
            raise CheckpointError(f"{url}: cannot reach the coordinator ({exc.strerror or exc})") from None
        if isinstance(exc, TimeoutError):
            raise CheckpointError(f"{url}: the coordinator sent nothing for {READ_TIMEOUT_S:g} s") from None
        if isinstance(exc, http.client.HTTPException) and not isinstance(
            exc, ConnectionError | http.client.IncompleteRead
        ):  # a status line, header or protocol that is not HTTP as we speak it: asking again gets the same
            raise RefusedAnswer(f"{url}: not an HTTP answer ({one_line(repr(exc), 200)})") from None
        raise CheckpointError(f"{url}: the download failed ({one_line(repr(exc), 200)})") from None
    finally:
        watchdog.cancel()
        connection.close()


def _copy(url: str, reply: http.client.HTTPResponse, dest: Path, limit: int, budget: Budget) -> int:
    """The body into `dest`; its size."""
    size = 0
    with open(dest, "wb") as out:
        while chunk := reply.read(min(CHUNK, limit + 1 - size)):
            size += len(chunk)
            if size > limit:
                raise RefusedAnswer(f"{url}: answer longer than the {limit:,} bytes allowed")
            out.write(chunk)
            budget.left(url)
    budget.left(url)  # the watchdog's hang-up at the deadline reads as an end: not a whole answer
    return size


def _declared_length(url: str, reply: http.client.HTTPResponse) -> int | None:
    declared = reply.getheader("Content-Length")
    if declared is None:
        return None
    if not (declared.isascii() and declared.isdigit()) or len(declared) > 19:  # also "5, 5": two headers
        raise RefusedAnswer(f"{url}: a malformed Content-Length ({one_line(declared, 40)!r})")
    return int(declared)


def _refusal(url: str, reply: http.client.HTTPResponse, missing: str) -> CheckpointError:
    said = _error_text(reply)
    if reply.status == 404 and not said:
        said = missing
    said = said or one_line(reply.reason or "", 80)
    if 300 <= reply.status < 400:
        said += " (redirects are not followed)"
    if reply.status == 503:
        return Busy(f"{url}: HTTP 503 {said}")
    may_pass = reply.status in MAY_PASS or 500 <= reply.status < 600
    return (CheckpointError if may_pass else RefusedAnswer)(f"{url}: HTTP {reply.status} {said}")


def _error_text(reply: http.client.HTTPResponse) -> str:
    """The coordinator's `{"error": "..."}` answer, when it sent one (at most 4 KiB of it read)."""
    try:
        doc = json.loads(reply.read(ERROR_BODY_BYTES).decode("utf-8"))
    except (OSError, ValueError, RecursionError, http.client.HTTPException):
        return ""
    error = doc.get("error") if isinstance(doc, dict) else None
    return one_line(error, MAX_ERROR_TEXT) if isinstance(error, str) else ""


class _Watchdog:
    """Shuts the connection's socket down at `deadline`, so that any blocked read returns then."""

    def __init__(self, connection: http.client.HTTPConnection, deadline: float) -> None:
        self._connection = connection
        self._deadline = deadline
        self._done = threading.Event()
        self.fired = False
        threading.Thread(target=self._watch, name="download deadline", daemon=True).start()

    def _watch(self) -> None:
        if self._done.wait(max(0.0, self._deadline - time.monotonic())):
            return
        self.fired = True
        while not self._done.is_set():  # the socket may still be connecting (its timeout ends that)
            sock = self._connection.sock
            if sock is not None:
                with contextlib.suppress(OSError):
                    sock.shutdown(socket.SHUT_RDWR)
                return
            self._done.wait(0.05)

    def cancel(self) -> None:
        self._done.set()
