"""Admission to runs that are not open to all (`hetnode bootstrap --admit allowlist FILE|tokens`).

Two coordinator-signed texts:
- a **join token** (`hetnode bootstrap token --name alice`): a bearer secret the operator hands a volunteer;
  it names no key, so it is spent once (the coordinator remembers the nonces it admitted);
- an **admission** (a certificate): what the coordinator gives a volunteer's key in exchange for a token,
  or for a key on the allowlist. It names the run, the peer id and an expiry; the volunteer carries it in
  its record, and every daemon of the run checks it before it reads anything else the peer says.

Both are `hn<kind>1.` + base64url(msgpack {body, sig}); the signature covers a domain tag and the body.
This module only frames and checks fields; signing lives in `hetnode/net/signing.py`.
"""

from __future__ import annotations

import base64
import binascii
from dataclasses import dataclass
from typing import Any, Literal

import msgpack

from hetnode.errors import WireError

AdmissionMode = Literal["open", "allowlist", "tokens"]
MODES: tuple[AdmissionMode, ...] = ("open", "allowlist", "tokens")
MAX_TEXT_CHARS = 2048  # either text, base64 included
MAX_NAME_CHARS = 64
PREFIX = {"token": "hntoken1.", "admission": "hnadmit1."}
DOMAIN = {"token": b"hetnode-join-token-v1", "admission": b"hetnode-admission-v1"}


@dataclass(frozen=True)
class JoinToken:
    name: str
    expires: float
    nonce: str  # 16 random bytes, hex


@dataclass(frozen=True)
class Admission:
    run: str
    peer: str
    name: str
    expires: float


def signing_message(kind: str, body: bytes) -> bytes:
    return DOMAIN[kind] + b"\x00" + body


def encode_signed(kind: str, body: bytes, signature: bytes) -> str:
    packed = msgpack.packb({"body": body, "sig": signature}, use_bin_type=True)
    return PREFIX[kind] + base64.urlsafe_b64encode(packed).decode().rstrip("=")


def decode_signed(kind: str, text: str) -> tuple[bytes, bytes]:
    """(body, signature) of a token or admission text; WireError when it is not one."""
    if not isinstance(text, str) or len(text) > MAX_TEXT_CHARS or not text.startswith(PREFIX[kind]):
        raise WireError(
            kind, f"not a hetnode {kind} (expected {PREFIX[kind]}…, at most {MAX_TEXT_CHARS} chars)"
        )
    encoded = text[len(PREFIX[kind]) :]
    try:
        packed = base64.urlsafe_b64decode(encoded + "=" * (-len(encoded) % 4))
        outer = msgpack.unpackb(packed, raw=False, max_bin_len=MAX_TEXT_CHARS, max_map_len=4)
    except (binascii.Error, ValueError, msgpack.ExtraData, msgpack.FormatError, msgpack.StackError):
        raise WireError(kind, "not valid base64 msgpack") from None
    if not isinstance(outer, dict) or set(outer) != {"body", "sig"}:
        raise WireError(kind, "must hold exactly body and sig")
    if not isinstance(outer["body"], bytes) or not isinstance(outer["sig"], bytes):
        raise WireError(kind, "body and sig must be bytes")
    return outer["body"], outer["sig"]


def token_body(token: JoinToken) -> bytes:
    return msgpack.packb(
        {"name": token.name, "expires": token.expires, "nonce": token.nonce}, use_bin_type=True
    )


def admission_body(admission: Admission) -> bytes:
    fields = {
        "run": admission.run,
        "peer": admission.peer,
        "name": admission.name,
        "expires": admission.expires,
    }
    return msgpack.packb(fields, use_bin_type=True)


def parse_token_body(body: bytes) -> JoinToken:
    fields = _fields(body, "token", {"name": str, "expires": float, "nonce": str})
    if not 0 < len(fields["name"]) <= MAX_NAME_CHARS or len(fields["nonce"]) != 32:
        raise WireError("token", "bad name or nonce")
    return JoinToken(**fields)


def parse_admission_body(body: bytes) -> Admission:
    fields = _fields(body, "admission", {"run": str, "peer": str, "name": str, "expires": float})
    if not all(0 < len(fields[k]) <= 128 for k in ("run", "peer")) or len(fields["name"]) > MAX_NAME_CHARS:
        raise WireError("admission", "bad run, peer or name")
    return Admission(**fields)


def _fields(body: bytes, kind: str, schema: dict[str, type]) -> dict[str, Any]:
    try:
        fields = msgpack.unpackb(body, raw=False, max_str_len=256, max_map_len=8, max_bin_len=0)
    except Exception:
        raise WireError(kind, "body is not msgpack") from None
    if not isinstance(fields, dict) or set(fields) != set(schema):
        raise WireError(kind, f"body must hold exactly {sorted(schema)}")
    for key, kind_of in schema.items():
        if not isinstance(fields[key], kind_of):
            raise WireError(f"{kind}.{key}", f"expected {kind_of.__name__}")
    return fields
