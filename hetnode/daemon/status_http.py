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
import time
import urllib.error
import urllib.request
from typing import Any

from hetnode.daemon.peer_address import URL_HINT, check_url, connect_reason, in_daemon_thread, read_capped
from hetnode.errors import HetnodeError
from hetnode.service.lifecycle import unless_stopped

SWARM_PATH = "/api/swarm"


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
