"""`hetnode status --peer http://HOST:PORT`: the status document as the coordinator serves it at
`/api/swarm`, in one HTTP request. No P2P daemon, no DHT join, no hivemind or torch import: the answer
comes in a fraction of a second where the DHT path (`status.py`) takes seconds.

The coordinator's view is the one it seals by, refreshed every heartbeat, so `time` in the document is
when the coordinator last read the records. A coordinator older than this route answers 404; the caller
then reads the swarm through the DHT as before. The answer is hostile input like anything from the
network: size- and time-capped (`peer_address.read_capped`), parsed as JSON, checked for its shape; the
table makes every string safe to print.
"""

from __future__ import annotations

import asyncio
import functools
import http.client
import json
import logging
import time
import urllib.error
import urllib.request
from typing import Any

from hetnode.daemon.peer_address import URL_HINT, check_url, connect_reason, in_daemon_thread, read_capped
from hetnode.errors import HetnodeError
from hetnode.protocol.status_signed import SIGNED_PATH, NotSigned, open_status
from hetnode.service.lifecycle import unless_stopped

SWARM_PATH = "/api/swarm"
log = logging.getLogger(__name__)


class Unanswered(HetnodeError):
    """The request failed on the way (refused, timed out, cut): the message is the reason alone."""


def fetch_swarm(url: str, timeout_s: float) -> dict[str, Any] | None:
    """One request (blocking): the status document at `url`, None when it is not served there (404)."""
    deadline = time.monotonic() + timeout_s
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as response:
            body = read_capped(response, url, deadline)
    except urllib.error.HTTPError as exc:
        if exc.code == 404:
            return None
        if exc.code == 503:
            raise HetnodeError(
                f"{url}: the coordinator has not read the swarm yet (it does every heartbeat); ask again "
                "in a few seconds"
            ) from None
        raise HetnodeError(
            f"{url} answered HTTP {exc.code} {exc.reason}: not a hetnode coordinator's status API; {URL_HINT}"
        ) from None
    except urllib.error.URLError as exc:
        reason = exc.reason
        raise Unanswered(connect_reason(reason) if isinstance(reason, BaseException) else reason) from None
    except http.client.HTTPException:  # e.g. the P2P port: it speaks multistream, not HTTP
        raise HetnodeError(
            f"{url} does not speak HTTP (is that the P2P port? pass its multiaddr instead); {URL_HINT}"
        ) from None
    except OSError as exc:  # reset or timed out after the request was sent
        raise Unanswered(connect_reason(exc)) from None
    try:
        document = json.loads(body)
    except ValueError:
        raise HetnodeError(f"{url} did not answer JSON: not a hetnode coordinator's status API") from None
    if not (
        isinstance(document, dict)
        and isinstance(document.get("peers"), list)
        and isinstance(document.get("chains"), list)
    ):
        raise HetnodeError(f"{url} did not answer a status document (peers and chains): not a coordinator")
    return document


async def read_served_status(peer: str, timeout_s: float, stop: asyncio.Event) -> dict[str, Any] | None:
    """The document the coordinator at URL `peer` serves, asked once within `timeout_s` (`--timeout`);
    None when it serves none (an older coordinator). `Stopped` as soon as `stop` is set."""
    parts = check_url(peer)
    url = f"{parts.scheme}://{parts.netloc}{SWARM_PATH}"
    ask = in_daemon_thread(functools.partial(fetch_swarm, url, timeout_s), timeout_s + 0.5)
    try:
        return await unless_stopped(stop, ask, f"waiting for {url}")
    except (Unanswered, TimeoutError) as exc:
        reason = str(exc) if isinstance(exc, Unanswered) else "no answer (timed out)"
        limit = f"(--timeout {timeout_s:g} s)"
        raise HetnodeError(f"cannot read the swarm from {url} {limit}: {reason}") from None


def signed_url(maddr: str, http_port: int) -> tuple[str, str] | None:
    """(URL of the signed document on `maddr`'s host at `http_port`, the peer id `maddr` names), or None
    for a multiaddr that is not /ip4|ip6|dns…/HOST/tcp/PORT/p2p/ID (a relayed one, say)."""
    parts = maddr.strip().split("/")
    if len(parts) != 7 or parts[0] or parts[3] != "tcp" or parts[5] != "p2p" or not parts[6]:
        return None
    kind, host = parts[1], parts[2]
    if kind == "ip6":
        host = f"[{host}]"
    elif kind not in ("ip4", "dns", "dns4", "dns6"):
        return None
    return f"http://{host}:{http_port}{SIGNED_PATH}", parts[6]


def fetch_signed(url: str, peer_id: str, timeout_s: float) -> dict[str, Any]:
    """One request (blocking): the status document at `url` when `peer_id` signed it; NotSigned (or an
    OSError, HTTPException) otherwise."""
    deadline = time.monotonic() + timeout_s
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as response:
            body = read_capped(response, url, deadline)
        answer = json.loads(body)
    except (OSError, http.client.HTTPException, ValueError, HetnodeError) as exc:
        raise NotSigned(f"{url}: {connect_reason(exc) if isinstance(exc, OSError) else exc}") from None
    return open_status(answer, peer_id, time.time())


async def read_signed_status(
    maddr: str, http_port: int | None, timeout_s: float, stop: asyncio.Event
) -> dict[str, Any] | None:
    """The coordinator's signed document from `maddr`'s host at `http_port` (its status port), in at most
    `timeout_s`; None when it is not there or not signed by the peer id `maddr` names (then the caller
    reads the DHT: a member's multiaddr, a coordinator on another port, an older one)."""
    target = signed_url(maddr, http_port) if http_port else None
    if target is None:
        return None
    url, peer_id = target
    ask = in_daemon_thread(functools.partial(fetch_signed, url, peer_id, timeout_s), timeout_s + 0.5)
    try:
        document = await unless_stopped(stop, ask, f"waiting for {url}")
    except (NotSigned, TimeoutError) as exc:
        log.info("no signed status at %s (%s): reading the swarm through the DHT", url, exc or "timed out")
        return None
    log.info("the swarm as the coordinator %s signed it at %s", peer_id[-8:], url)
    return document
