"""Author signatures on sync payloads (docs/security.md, "Who is trusted with what"): sign with the daemon's
identity, verify against the key
the envelope carries, and name the author by the peer id that key derives to."""

from __future__ import annotations

from hivemind.utils.crypto import RSAPublicKey

from hetnode.errors import HetnodeError, WireError
from hetnode.net.identity import Identity, peer_id_of
from hetnode.wire.admission import decode_signed, encode_signed
from hetnode.wire.admission import signing_message as admission_message
from hetnode.wire.signed_payload import SignedEnvelope, decode_envelope, encode_envelope, signing_message


def sign_payload(identity: Identity, run: str, body: bytes) -> bytes:
    """The envelope of `body` (an encoded payload message) signed by `identity` for `run`."""
    key = identity.private_key.get_public_key().to_bytes()
    signature = identity.private_key.sign(signing_message(run, body))
    return encode_envelope(SignedEnvelope(key, signature, body))


def open_payload(run: str, data: bytes, max_bytes: int) -> tuple[str, bytes]:
    """(author peer id, payload message) of a signed envelope; WireError when it is malformed or forged."""
    envelope = decode_envelope(data, max_bytes)
    try:
        key = RSAPublicKey.from_bytes(envelope.key)
        author = peer_id_of(key)
        valid = key.verify(signing_message(run, envelope.body), envelope.signature)
    except Exception:  # a key that does not parse is as bad as a signature that does not verify
        raise WireError("envelope.key", "not an RSA public key") from None
    if not valid:
        raise WireError("envelope.sig", f"the signature does not verify under the key of {author[-8:]}")
    return author, envelope.body


def sign_text(identity: Identity, kind: str, body: bytes) -> str:
    """A join token or an admission (`hetnode.wire.admission`) signed by `identity` (the coordinator)."""
    return encode_signed(kind, body, identity.private_key.sign(admission_message(kind, body)))


def verify_text(kind: str, text: str, signer: RSAPublicKey) -> bytes:
    """The body of a token or admission if `signer` signed it; WireError otherwise."""
    body, signature = decode_signed(kind, text)
    if not signer.verify(admission_message(kind, body), signature):
        raise WireError(kind, "the signature does not verify under the coordinator's key")
    return body


def signer_key(text: str, peer_id: str) -> RSAPublicKey:
    """The public key in OpenSSH `text`, checked to be the key of `peer_id`; HetnodeError otherwise."""
    try:
        key = RSAPublicKey.from_bytes(text.encode())
    except Exception:
        raise HetnodeError("not an RSA public key") from None
    if peer_id_of(key) != peer_id:
        raise HetnodeError(f"the key is not the key of {peer_id}")
    return key
