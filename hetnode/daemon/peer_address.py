"""`--peer` as a coordinator URL: `hetnode join --peer http://coordinator:8400` reads the coordinator's peer
id and P2P port from its status API and dials the host it just reached, so a compose file or a volunteer's
command line needs no peer id copied by hand. A multiaddr is passed through unchanged.

The answer is hostile input like anything from the network: size-capped, parsed as JSON, the peer id checked
by the same parser as a typed multiaddr, the port an int in range.
"""

from __future__ import annotations

import ipaddress
import json
import logging
import socket
import time
import urllib.error
import urllib.request
from urllib.parse import urlsplit

from hetnode.errors import HetnodeError
from hetnode.net.identity import peer_id_from_maddr

log = logging.getLogger(__name__)

MAX_STATUS_BYTES = 4 * 2**20
STATUS_PATH = "/api/status"


def is_url(peer: str) -> bool:
    return peer.startswith(("http://", "https://"))


def maddr_from_status(status: object, host_ip: str) -> str:
    """The multiaddr to dial: the coordinator's peer id and TCP port, at the address we reached it on."""
    if not isinstance(status, dict):
        raise HetnodeError("coordinator status is not a JSON object")
    peer_id, maddrs = status.get("peer_id"), status.get("maddrs")
    if not isinstance(peer_id, str) or not isinstance(maddrs, list):
        raise HetnodeError("coordinator status lacks peer_id and maddrs")
    for maddr in maddrs:
        parts = maddr.split("/") if isinstance(maddr, str) else []
        if "tcp" in parts and parts.index("tcp") + 1 < len(parts):
            port = parts[parts.index("tcp") + 1]
            if port.isdigit() and 0 < int(port) < 65536:
                family = "ip6" if ipaddress.ip_address(host_ip).version == 6 else "ip4"
                resolved = f"/{family}/{host_ip}/tcp/{int(port)}/p2p/{peer_id}"
                peer_id_from_maddr(resolved)  # a bad peer id fails here, with the parser's error
                return resolved
    raise HetnodeError(f"none of the coordinator's addresses has a TCP port: {maddrs!r:.200}")


def resolve_peer(peer: str, timeout_s: float) -> str:
    """A multiaddr as is; a coordinator URL → the multiaddr to dial (retried until `timeout_s`)."""
    if not is_url(peer):
        return peer
    parts = urlsplit(peer)
    if not parts.hostname:
        raise HetnodeError(f"--peer {peer!r}: no host in the URL")
    url = f"{parts.scheme}://{parts.netloc}{STATUS_PATH}"
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            host_ip = socket.getaddrinfo(parts.hostname, None, proto=socket.IPPROTO_TCP)[0][4][0]
            with urllib.request.urlopen(url, timeout=10.0) as response:
                body = response.read(MAX_STATUS_BYTES + 1)
            if len(body) > MAX_STATUS_BYTES:
                raise HetnodeError(f"{url} answered more than {MAX_STATUS_BYTES} bytes")
            maddr = maddr_from_status(json.loads(body), host_ip)
            log.info("coordinator at %s is %s", peer, maddr)
            return maddr
        except (OSError, urllib.error.URLError, ValueError) as exc:  # not up yet, or not JSON
            if time.monotonic() > deadline:
                raise HetnodeError(f"cannot read the coordinator's address from {url}: {exc}") from None
            log.info("waiting for %s: %s", url, exc)
            time.sleep(2.0)
