"""The envelope every sync payload travels in: the author's public key and signature around the message.

The signature covers a domain tag, the run id and the sha256 of the payload message (whose header names the
author, round and shard), so any holder (the sealer, a stand-in, a peer that fetched it) can serve a payload
but nobody can alter one or fabricate one under another peer's name (docs/security.md, "Who is trusted with
what"). The content address that announcements and seals list is the sha256 of the whole envelope.

This module only frames bytes; the signing itself lives in `hetnode/net/signing.py` (it needs the keys).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import msgpack

from hetnode.errors import WireError

ENVELOPE_TYPE = "signed"
ENVELOPE_VERSION = 1
SIGNING_DOMAIN = b"hetnode-sync-payload-v1"
MAX_KEY_BYTES = 1024  # an OpenSSH-encoded RSA public key (≈ 380 bytes at 2048 bits); caps verify cost
MAX_SIGNATURE_BYTES = 1024


@dataclass(frozen=True)
class SignedEnvelope:
    key: bytes  # the author's public key, as hivemind's RSAPublicKey.to_bytes() writes it
    signature: bytes
    body: bytes  # the payload message (`hetnode.wire.sync_payload`)


def signing_message(run: str, body: bytes) -> bytes:
    """What the author signs: domain tag, run id, sha256 of the payload message."""
    return b"\x00".join([SIGNING_DOMAIN, run.encode(), hashlib.sha256(body).digest()])


def encode_envelope(envelope: SignedEnvelope) -> bytes:
    return msgpack.packb(
        {
            "type": ENVELOPE_TYPE,
            "v": ENVELOPE_VERSION,
            "key": envelope.key,
            "sig": envelope.signature,
            "body": envelope.body,
        },
        use_bin_type=True,
    )


def decode_envelope(data: bytes, max_bytes: int) -> SignedEnvelope:
    """Parse the envelope (size first, then exact fields); the signature is checked by the caller."""
    if len(data) > max_bytes:
        raise WireError("size", f"{len(data)} bytes exceeds the limit of {max_bytes}")
    try:
        message = msgpack.unpackb(
            data, raw=False, strict_map_key=True, max_bin_len=max_bytes, max_str_len=64, max_map_len=8
        )
    except Exception as exc:  # msgpack raises several types for malformed input
        raise WireError("envelope", f"not a valid msgpack message ({type(exc).__name__})") from None
    if not isinstance(message, dict) or set(message) != {"type", "v", "key", "sig", "body"}:
        raise WireError("envelope", "must be a map of exactly type, v, key, sig, body")
    if message["type"] != ENVELOPE_TYPE or message["v"] != ENVELOPE_VERSION:
        raise WireError("envelope.type", f"expected {ENVELOPE_TYPE!r} version {ENVELOPE_VERSION}")
    key, signature, body = message["key"], message["sig"], message["body"]
    for field, value, limit in (("key", key, MAX_KEY_BYTES), ("sig", signature, MAX_SIGNATURE_BYTES)):
        if not isinstance(value, bytes) or not 0 < len(value) <= limit:
            raise WireError(f"envelope.{field}", f"must be 1..{limit} bytes")
    if not isinstance(body, bytes):
        raise WireError("envelope.body", "must be bytes")
    return SignedEnvelope(key, signature, body)
