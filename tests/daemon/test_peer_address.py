"""`--peer http://coordinator:8400`: the multiaddr comes from the coordinator's status API, checked."""

from __future__ import annotations

import json

import pytest

from hetnode.daemon.peer_address import is_url, maddr_from_status, resolve_peer
from hetnode.errors import HetnodeError
from hetnode.service.http_server import HttpServer, Response

PEER_ID = "QmYyQSo1c1Ym7orWxLYvCrM2EmxFTANf8wXmmE7DWjhx5N"


def test_the_reached_host_and_the_advertised_port_make_the_multiaddr():
    status = {"peer_id": PEER_ID, "maddrs": [f"/ip4/172.18.0.2/tcp/31337/p2p/{PEER_ID}"]}
    assert maddr_from_status(status, "10.0.0.5") == f"/ip4/10.0.0.5/tcp/31337/p2p/{PEER_ID}"
    assert maddr_from_status(status, "::1").startswith("/ip6/::1/tcp/31337/")


@pytest.mark.parametrize(
    "status",
    [
        [],
        {"peer_id": PEER_ID},
        {"peer_id": PEER_ID, "maddrs": ["/ip4/1.2.3.4/udp/5"]},
        {"peer_id": PEER_ID, "maddrs": ["/ip4/1.2.3.4/tcp/99999"]},
        {"peer_id": "not-a-peer-id", "maddrs": ["/ip4/1.2.3.4/tcp/31337"]},
    ],
)
def test_a_bad_status_document_is_refused(status):
    with pytest.raises(HetnodeError):
        maddr_from_status(status, "127.0.0.1")


def test_a_multiaddr_passes_through_and_a_url_is_read_from_the_status_api():
    maddr = f"/ip4/127.0.0.1/tcp/31337/p2p/{PEER_ID}"
    assert not is_url(maddr) and resolve_peer(maddr, 1.0) == maddr
    body = json.dumps({"peer_id": PEER_ID, "maddrs": [f"/ip4/0.0.0.0/tcp/4242/p2p/{PEER_ID}"]}).encode()
    server = HttpServer("127.0.0.1", 0, {"/api/status": lambda: Response(body, "application/json")})
    server.start()
    try:
        assert (
            resolve_peer(f"http://127.0.0.1:{server.port}", 5.0) == f"/ip4/127.0.0.1/tcp/4242/p2p/{PEER_ID}"
        )
    finally:
        server.stop()


def test_an_unreachable_coordinator_url_fails_after_the_timeout():
    server = HttpServer("127.0.0.1", 0, {})
    port = server.start()
    server.stop()  # nothing listens there now
    with pytest.raises(HetnodeError, match="cannot read the coordinator's address"):
        resolve_peer(f"http://127.0.0.1:{port}", 0.5)
