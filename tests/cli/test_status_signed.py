"""The coordinator's signed status document (`hetnode/protocol/status_signed.py`): taken only when the key
derives to the peer id asked for, the signature verifies and the document is recent; every other answer a
stranger could put at that port is refused with its reason (then `status` reads the DHT)."""

import base64
import json
import time

import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ed25519

from hetnode.daemon.status_http import signed_url
from hetnode.net.identity import ephemeral_identity, peer_id_of
from hetnode.protocol.status_signed import MAX_AGE_S, NotSigned, open_status, peer_id_of_rsa, sign_status

COORDINATOR = ephemeral_identity()
STRANGER = ephemeral_identity()


def document(peer_id: str = COORDINATOR.peer_id, at: float | None = None) -> dict:
    return {"coordinator": peer_id, "peers": [], "chains": [], "run": "r", "time": at or time.time()}


def test_the_light_peer_id_is_libp2p_s():
    key = serialization.load_ssh_public_key(COORDINATOR.private_key.get_public_key().to_bytes())
    assert peer_id_of_rsa(key) == peer_id_of(COORDINATOR.private_key.get_public_key()) == COORDINATOR.peer_id


def test_a_document_the_coordinator_signed_is_taken():
    signed = sign_status(COORDINATOR.private_key, document())
    assert open_status(json.loads(json.dumps(signed)), COORDINATOR.peer_id, time.time()) == json.loads(
        signed["document"]
    )


def forged_answers() -> dict[str, object]:
    good = sign_status(COORDINATOR.private_key, document())
    ssh_ed25519 = (
        ed25519.Ed25519PrivateKey.generate()
        .public_key()
        .public_bytes(serialization.Encoding.OpenSSH, serialization.PublicFormat.OpenSSH)
    )
    return {
        "signed by a stranger": sign_status(STRANGER.private_key, document()),
        "a stranger's document under the coordinator's id": sign_status(STRANGER.private_key, document())
        | {"key": good["key"]},
        "edited after signing": good | {"document": good["document"].replace('"run":"r"', '"run":"x"')},
        "signed by the coordinator, naming another": sign_status(
            COORDINATOR.private_key, document(STRANGER.peer_id)
        ),
        "old": sign_status(COORDINATOR.private_key, document(at=time.time() - 2 * MAX_AGE_S)),
        "not base64": good | {"signature": "@@@"},
        "not an RSA key": good | {"key": base64.b64encode(ssh_ed25519).decode()},
        "no key": {"document": good["document"], "signature": good["signature"]},
        "a list": [good],
    }


@pytest.mark.parametrize("case", list(forged_answers()))
def test_anything_else_is_refused_with_its_reason(case):
    with pytest.raises(NotSigned) as refused:
        open_status(forged_answers()[case], COORDINATOR.peer_id, time.time())
    assert str(refused.value)


def test_the_signed_url_comes_from_the_multiaddr_s_host_and_the_status_port():
    pid = COORDINATOR.peer_id
    assert signed_url(f"/ip4/127.0.0.1/tcp/31337/p2p/{pid}", 8400) == (
        "http://127.0.0.1:8400/api/swarm/signed",
        pid,
    )
    assert signed_url(f"/ip6/::1/tcp/1/p2p/{pid}", 9) == ("http://[::1]:9/api/swarm/signed", pid)
    assert signed_url(f"/ip4/1.2.3.4/tcp/1/p2p/{pid}/p2p-circuit/p2p/{pid}", 8400) is None  # relayed
    assert signed_url("/unix/x/tcp/1/p2p/y", 8400) is None
