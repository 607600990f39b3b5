"""`--peer` as a coordinator URL: `hetnode join --peer http://coordinator:8400` reads the coordinator's peer
id and P2P port from its status API and dials the host it just reached, so a compose file or a volunteer's
command line needs no peer id copied by hand. A multiaddr is passed through unchanged.

The answer is hostile input like anything from the network: size-capped, time-capped, parsed as JSON, the
peer id checked by the same parser as a typed multiaddr, the port an int in range. Each request runs in a
daemon thread the event loop only waits on, so a Ctrl+C or the timeout ends the wait at once (a thread
still blocked in a socket call ends by its own socket timeout, and never holds up the exit).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import http.client
import ipaddress
import json
import logging
import socket
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from typing import TypeVar
from urllib.parse import SplitResult, urlsplit

from hetnode.errors import ConfigError, HetnodeError
from hetnode.service.http_server import DEFAULT_STATUS_PORT
from hetnode.service.lifecycle import Stopped, sleep_or_stop, unless_stopped

log = logging.getLogger(__name__)

MAX_STATUS_BYTES = 4 * 2**20
STATUS_PATH = "/api/status"
ATTEMPT_S = 10.0  # one request: a coordinator answers in milliseconds
RETRY_S = 2.0
URL_HINT = f"the coordinator's status URL is http://HOST:PORT, PORT its --http-port ({DEFAULT_STATUS_PORT})"
T = TypeVar("T")


class NotAnsweringYet(HetnodeError):
    """The coordinator did not answer (yet): worth asking again while it may still be starting."""


def is_url(peer: str) -> bool:
    return peer.startswith(("http://", "https://"))


def check_url(peer: str) -> SplitResult:
    """The parts of a coordinator URL, or an error (exit 2) that says what is wrong with it."""
    try:
        parts = urlsplit(peer)
        port = parts.port  # raises on a port that is not a number in range
    except ValueError as exc:
        raise ConfigError("--peer", "peer", f"{peer!r}: {exc}; {URL_HINT}") from None
    if not parts.hostname:
        raise ConfigError("--peer", "peer", f"{peer!r}: no host in the URL; {URL_HINT}")
    if port == 0:
        raise ConfigError("--peer", "peer", f"{peer!r}: port 0 is not a port to connect to; {URL_HINT}")
    return parts


def check_peer(peer: str, timeout_flag: str) -> str:
    """`--peer` checked before anything starts: a coordinator URL, or a multiaddr ending in /p2p/<peer id>.
    The error (exit 2: an argument error) shows both forms and the flag that says how long the command
    waits."""
    if is_url(peer):
        check_url(peer)
        return peer
    if "://" in peer:  # a URL of another scheme: say which ones are read, not "no /p2p/ part"
        raise ConfigError(
            "--peer",
            "peer",
            f"{peer!r}: only http:// and https:// URLs are read; {URL_HINT}; or pass a multiaddr from the "
            "coordinator's READY line (ending in /p2p/<peer id>)",
        )
    from hetnode.net.peer_ids import peer_id_from_maddr

    try:
        peer_id_from_maddr(peer)
    except HetnodeError as exc:
        raise ConfigError(
            "--peer",
            "peer",
            f"{exc}, or pass the coordinator's status URL instead, http://HOST:PORT with PORT its "
            f"--http-port (default {DEFAULT_STATUS_PORT}); {timeout_flag} sets how long to wait for it "
            "to answer",
        ) from None
    return peer


def another_peer_error(peer_maddr: str, given: str, actual: str) -> ConfigError:
    """`--peer` names `given`, but `actual` answers at its address: an argument error (exit 2), at once,
    since waiting cannot mend it. Both ids, the multiaddr that would reach who answers, and the URL form
    (which always leads to the coordinator's current id)."""
    address = peer_maddr.split("/p2p/")[0]
    parts = address.split("/")
    host = parts[2] if len(parts) > 2 else "HOST"
    url_host = f"[{host}]" if ":" in host else host
    return ConfigError(
        "--peer",
        "peer",
        f"something answered at {address} with another peer id ({actual}), not {given}, the one you gave: "
        "the coordinator was probably restarted with another --data-dir (a new key, so a new peer id). Use "
        f"the new multiaddr printed in its READY line ({address}/p2p/{actual}, if that is the coordinator "
        f"you mean), or its status URL http://{url_host}:PORT (PORT its --http-port, default "
        f"{DEFAULT_STATUS_PORT}), which always leads to its current peer id",
    )


def maddr_from_status(status: object, host_ip: str) -> str:
    """The multiaddr to dial: the coordinator's peer id and TCP port, at the address we reached it on."""
    if not isinstance(status, dict):
        raise HetnodeError("coordinator status is not a JSON object")
    peer_id, maddrs = status.get("peer_id"), status.get("maddrs")
    if not isinstance(peer_id, str) or not isinstance(maddrs, list):
        # the status page answers before its first update: `{}` with a leaderboard
        raise NotAnsweringYet("coordinator status lacks peer_id and maddrs")
    for maddr in maddrs:
        parts = maddr.split("/") if isinstance(maddr, str) else []
        if "tcp" in parts and parts.index("tcp") + 1 < len(parts):
            port = parts[parts.index("tcp") + 1]
            if port.isdigit() and 0 < int(port) < 65536:
                family = "ip6" if ipaddress.ip_address(host_ip).version == 6 else "ip4"
                resolved = f"/{family}/{host_ip}/tcp/{int(port)}/p2p/{peer_id}"
                from hetnode.net.peer_ids import peer_id_from_maddr

                peer_id_from_maddr(resolved)  # a bad peer id fails here, with the parser's error
                return resolved
    raise HetnodeError(f"none of the coordinator's addresses has a TCP port: {maddrs!r:.200}")


def connect_reason(exc: BaseException) -> str:
    """Why a connection failed, in words a user can act on."""
    if isinstance(exc, ConnectionRefusedError):
        return "connection refused: nothing listens there (is the coordinator running, on that port?)"
    if isinstance(exc, TimeoutError):
        return "no answer (timed out)"
    if isinstance(exc, socket.gaierror):
        return f"cannot resolve the host name ({exc.strerror})"
    return getattr(exc, "strerror", None) or str(exc) or type(exc).__name__


def read_capped(response: http.client.HTTPResponse, url: str, deadline: float) -> bytes:
    length = response.headers.get("Content-Length", "")
    if length.isdigit() and int(length) > MAX_STATUS_BYTES:
        raise HetnodeError(f"{url} answered {length} bytes, more than {MAX_STATUS_BYTES}: not a coordinator")
    chunks, size = [], 0
    while chunk := response.read1(65536):  # each read is bounded by the socket timeout, the whole by ours
        size += len(chunk)
        if size > MAX_STATUS_BYTES:
            raise HetnodeError(f"{url} answered more than {MAX_STATUS_BYTES} bytes: not a coordinator")
        if time.monotonic() > deadline:
            raise NotAnsweringYet("the answer took too long")
        chunks.append(chunk)
    return b"".join(chunks)


def fetch_peer_address(parts: SplitResult, timeout_s: float) -> str:
    """One request to the coordinator's status API (blocking, within about `timeout_s`): its multiaddr."""
    url = f"{parts.scheme}://{parts.netloc}{STATUS_PATH}"
    deadline = time.monotonic() + timeout_s
    try:
        host_ip = socket.getaddrinfo(parts.hostname, None, proto=socket.IPPROTO_TCP)[0][4][0]
        with urllib.request.urlopen(url, timeout=timeout_s) as response:
            body = read_capped(response, url, deadline)
    except urllib.error.HTTPError as exc:
        if exc.code >= 500:  # a proxy in front of a coordinator still starting
            raise NotAnsweringYet(f"HTTP {exc.code} {exc.reason}") from None
        raise HetnodeError(
            f"{url} answered HTTP {exc.code} {exc.reason}: not a hetnode coordinator's status API; {URL_HINT}"
        ) from None
    except urllib.error.URLError as exc:
        reason = exc.reason
        raise NotAnsweringYet(
            connect_reason(reason) if isinstance(reason, BaseException) else str(reason)
        ) from None
    except OSError as exc:  # refused, reset or timed out after the request was sent
        raise NotAnsweringYet(connect_reason(exc)) from None
    except http.client.HTTPException:  # e.g. the P2P port: it speaks multistream, not HTTP
        raise HetnodeError(
            f"{url} does not speak HTTP (is that the P2P port? pass its multiaddr instead); {URL_HINT}"
        ) from None
    try:
        document = json.loads(body)
    except ValueError:
        raise HetnodeError(f"{url} did not answer JSON: not a hetnode coordinator's status API") from None
    return maddr_from_status(document, host_ip)


async def in_daemon_thread(work: Callable[[], T], timeout_s: float) -> T:
    """`work()` in a daemon thread, awaited for at most `timeout_s` (then TimeoutError). Unlike
    `asyncio.to_thread`, an abandoned call is never joined: not by the loop's executor, not at exit."""
    loop = asyncio.get_running_loop()
    future: asyncio.Future[T] = loop.create_future()

    def settle(result: T | None, error: BaseException | None) -> None:
        if future.done():  # abandoned: we stopped or timed out
            return
        if error is not None:
            future.set_exception(error)
        else:
            future.set_result(result)

    def run() -> None:
        try:
            result, error = work(), None
        except BaseException as exc:  # handed to the loop, raised there
            result, error = None, exc
        with contextlib.suppress(RuntimeError):  # the loop is closed: nobody waits any more
            loop.call_soon_threadsafe(settle, result, error)

    threading.Thread(target=run, name="peer-address", daemon=True).start()
    return await asyncio.wait_for(future, timeout_s)


async def resolve_peer(
    peer: str, timeout_s: float, stop: asyncio.Event, retry: bool = True, flag: str = "--connect-timeout"
) -> str:
    """A multiaddr as is; a coordinator URL → the multiaddr to dial. With `retry`, a coordinator that does
    not answer yet is asked again every RETRY_S until `timeout_s` (the value of `flag`); without, once.
    `Stopped` on `stop`. The error says why the last attempt failed: refused, timed out, not a coordinator."""
    if not is_url(peer):
        return peer
    parts = check_url(peer)
    url = f"{parts.scheme}://{parts.netloc}{STATUS_PATH}"
    deadline = time.monotonic() + timeout_s
    while True:
        budget = max(0.1, min(ATTEMPT_S, deadline - time.monotonic()))
        try:
            maddr = await unless_stopped(
                stop,
                in_daemon_thread(functools.partial(fetch_peer_address, parts, budget), budget + 0.5),
                f"waiting for {url}",
            )
            log.info("coordinator at %s is %s", peer, maddr)
            return maddr
        except (NotAnsweringYet, TimeoutError) as exc:
            reason = str(exc) if isinstance(exc, NotAnsweringYet) else "no answer (timed out)"
            left = deadline - time.monotonic()
            if not retry or left <= 0.05:
                limit = f"within {timeout_s:g} s ({flag})" if retry else f"({flag} {timeout_s:g} s)"
                raise HetnodeError(
                    f"cannot read the coordinator's address from {url} {limit}: {reason}"
                ) from None
            log.info("waiting for %s: %s", url, reason)
        if await sleep_or_stop(stop, min(RETRY_S, left)):
            raise Stopped(f"stopped while waiting for {url}")
