"""`hetnode status --peer <multiaddr>` in a fraction of a second: the coordinator's status document over
HTTP, signed by the key its peer id names.

The DHT read (`daemon/status.py`) starts a P2P daemon and imports hivemind, which imports torch: seconds on
a small machine. A multiaddr names a peer id, so the document can come from anywhere, the coordinator's HTTP
port included, as long as it is signed by that peer id's key. The coordinator signs its document once a
heartbeat (`sign_status`: no signature per request, so asking costs it nothing) and serves it at
`/api/swarm/signed`; `open_status` takes it only when the key derives to the peer id asked for, the
signature verifies and the document is recent (`MAX_AGE_S`, clocks may differ a little), and otherwise says
why, and the caller reads the DHT as before. Light on purpose: the standard library, `cryptography` and
`base58` (no hivemind), so the status command stays fast.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import json
from typing import Any

import base58
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import padding, rsa

SIGNED_PATH = "/api/swarm/signed"
CONTEXT = b"hetnode-status-v1\0"  # a status signature can never be taken for any other signed thing
MAX_AGE_S = 300.0  # a document read longer ago than this (by the coordinator's clock) is not taken
MAX_KEY_BYTES = 4096
MAX_SIGNATURE_BYTES = 1024


class NotSigned(Exception):
    """The answer is not a recent status document signed by the peer id asked for (the reason)."""


def sign_status(private_key: Any, document: dict[str, Any]) -> dict[str, str]:
    """What the coordinator serves: the document as JSON text, its public key (OpenSSH form, as hivemind
    writes it) and the signature of the text. `private_key`: hivemind's RSAPrivateKey (PSS, SHA-256)."""
    text = json.dumps(document, separators=(",", ":"))  # the order the DHT read prints
    public = private_key.get_public_key().to_bytes()
    signature = private_key.sign(CONTEXT + text.encode())  # hivemind's sign answers base64 already
    return {"document": text, "key": base64.b64encode(public).decode(), "signature": signature.decode()}


def peer_id_of_rsa(key: rsa.RSAPublicKey) -> str:
    """libp2p's peer id of an RSA key: base58 of the sha2-256 multihash of the protobuf-wrapped DER key
    (the protobuf by hand: field 1 key type RSA = 0, field 2 the DER bytes)."""
    der = key.public_bytes(serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo)
    length, size = bytearray(), len(der)
    while True:
        low, size = size & 0x7F, size >> 7
        length.append(low | (0x80 if size else 0))
        if not size:
            break
    wrapped = b"\x08\x00\x12" + bytes(length) + der
    return base58.b58encode(b"\x12\x20" + hashlib.sha256(wrapped).digest()).decode()


def open_status(answer: object, peer_id: str, now: float) -> dict[str, Any]:
    """The status document in `answer` (a parsed JSON body) when `peer_id` signed it within MAX_AGE_S of
    `now`; NotSigned otherwise."""
    if not isinstance(answer, dict) or not all(
        isinstance(answer.get(field), str) for field in ("document", "key", "signature")
    ):
        raise NotSigned("not a signed status document")
    try:
        raw_key = base64.b64decode(answer["key"], validate=True)
        signature = base64.b64decode(answer["signature"], validate=True)
    except (binascii.Error, ValueError):
        raise NotSigned("the key or the signature is not base64") from None
    if len(raw_key) > MAX_KEY_BYTES or len(signature) > MAX_SIGNATURE_BYTES:
        raise NotSigned("the key or the signature is too long")
    try:
        key = serialization.load_ssh_public_key(raw_key)
    except (ValueError, TypeError, binascii.Error):
        raise NotSigned("the key does not parse") from None
    if not isinstance(key, rsa.RSAPublicKey):
        raise NotSigned("the key is not an RSA key")
    signer = peer_id_of_rsa(key)
    if signer != peer_id:
        raise NotSigned(f"signed by {signer}, not by {peer_id}")
    text = answer["document"]
    try:
        key.verify(
            signature,
            CONTEXT + text.encode(),
            padding.PSS(mgf=padding.MGF1(hashes.SHA256()), salt_length=padding.PSS.AUTO),
            hashes.SHA256(),
        )
    except InvalidSignature:
        raise NotSigned("the signature does not verify") from None
    try:
        document = json.loads(text)
    except ValueError:
        raise NotSigned("the signed document is not JSON") from None
    if not (
        isinstance(document, dict)
        and isinstance(document.get("peers"), list)
        and isinstance(document.get("chains"), list)
        and document.get("coordinator") == peer_id
    ):
        raise NotSigned("the signed document is not the coordinator's status document")
    read_at = document.get("time")
    if not isinstance(read_at, int | float) or abs(now - float(read_at)) > MAX_AGE_S:
        raise NotSigned(f"the document is not recent (read at {read_at!r}, now {now:.0f})")
    return document
