"""A daemon's identity: one RSA key that is both its libp2p peer id and the signer of its DHT records.

Using one key for both lets anybody check that a record under subkey `[owner:<public key>]` was written
by the peer whose id is derived from that key, so records cannot speak for another peer.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path

import base58
import multihash
from cryptography.hazmat.primitives import serialization
from hivemind.p2p import P2P
from hivemind.proto import crypto_pb2
from hivemind.utils.crypto import RSAPrivateKey, RSAPublicKey

from hetnode.errors import HetnodeError


@dataclass(frozen=True)
class Identity:
    path: Path | None  # None: ephemeral (a status query)
    private_key: RSAPrivateKey
    peer_id: str


def load_or_create_identity(path: Path) -> Identity:
    """Read the key at `path`, or create it (mode 0400) so the next start has the same peer id."""
    path = Path(path)
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        P2P.generate_identity(str(path))
    try:
        protobuf = crypto_pb2.PrivateKey.FromString(path.read_bytes())
        if protobuf.key_type != crypto_pb2.KeyType.RSA:
            raise ValueError("not an RSA key")
        key = _private_key_from_der(protobuf.data)
    except Exception as exc:
        raise HetnodeError(
            f"identity file {path} is unreadable ({exc}); move it away to create a new one"
        ) from None
    return Identity(path=path, private_key=key, peer_id=peer_id_of(key.get_public_key()))


def ephemeral_identity() -> Identity:
    key = RSAPrivateKey()
    return Identity(path=None, private_key=key, peer_id=peer_id_of(key.get_public_key()))


def write_identity_file(identity: Identity, path: Path) -> None:
    """Write the key in the protobuf format p2pd reads (for an ephemeral identity, into a temp dir)."""
    protobuf = crypto_pb2.PrivateKey(key_type=crypto_pb2.KeyType.RSA, data=identity.private_key.to_bytes())
    path.write_bytes(protobuf.SerializeToString())
    path.chmod(0o400)


def owner_subkey(identity: Identity) -> bytes:
    """The DHT subkey only this identity can write (hivemind's `[owner:...]` marker)."""
    return b"[owner:" + identity.private_key.get_public_key().to_bytes() + b"]"


def peer_id_of_subkey(subkey: bytes) -> str | None:
    """The peer id that owns an `[owner:...]` subkey, or None when it is not one."""
    if not (isinstance(subkey, bytes) and subkey.startswith(b"[owner:") and subkey.endswith(b"]")):
        return None
    try:
        return peer_id_of(RSAPublicKey.from_bytes(subkey[len(b"[owner:") : -1]))
    except Exception:
        return None


def peer_id_of(public_key: RSAPublicKey) -> str:
    """libp2p's peer id of an RSA key: multihash sha2-256 of the protobuf-wrapped DER public key."""
    der = public_key._public_key.public_bytes(  # noqa: SLF001 - hivemind keeps the key object private
        encoding=serialization.Encoding.DER, format=serialization.PublicFormat.SubjectPublicKeyInfo
    )
    wrapped = crypto_pb2.PublicKey(key_type=crypto_pb2.RSA, data=der).SerializeToString()
    digest = multihash.encode(hashlib.sha256(wrapped).digest(), multihash.coerce_code("sha2-256"))
    return base58.b58encode(digest).decode()


def _private_key_from_der(der: bytes) -> RSAPrivateKey:
    key = RSAPrivateKey.__new__(RSAPrivateKey)
    key.__setstate__({"_private_key": der})  # hivemind's own unpickling path
    return key


def check_peer_id(text: str, what: str = "peer id") -> str:
    """`text` if it is a libp2p peer id (base58 of a sha2-256 multihash); HetnodeError naming `what`."""
    try:
        decoded = multihash.decode(base58.b58decode(text))
    except Exception:
        raise HetnodeError(f"{what}: {text[:80]!r} is not a peer id (Qm…, as READY lines print it)") from None
    if decoded.name != "sha2-256":
        raise HetnodeError(f"{what}: {text[:80]!r} is not an RSA peer id")
    return text
