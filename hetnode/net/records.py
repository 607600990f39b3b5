"""The DHT record schemas of a run. hivemind's SchemaValidator enforces them on every node that stores
or relays a record; RSASignatureValidator makes `[owner:...]` subkeys writable only by their owner.

Keys (hivemind prefixes them as `{run}_{field}`):
- `manifest`: subkey = the coordinator's owner key; a small versioned envelope around the msgpack body,
  so that a daemon of another protocol version can still read it and refuse with a clear message.
- `round`: subkey = the coordinator's owner key; the current boundary (outer step) number.
- `peers`: subkey = each peer's owner key; what the peer says about itself.
"""

from __future__ import annotations

import pydantic.v1 as pydantic
from hivemind.dht.schema import BytesWithPublicKey, SchemaValidator

MAX_NAME_CHARS = 64
ShardName = pydantic.constr(strict=True, regex=r"^(embed|head|[0-9]{1,4})$")
Digest = pydantic.constr(strict=True, regex=r"^[0-9a-f]{8,64}$")
Sha256 = pydantic.constr(strict=True, regex=r"^[0-9a-f]{64}$")
MAX_MANIFEST_BYTES = 64 * 1024


class ManifestRecord(pydantic.BaseModel):
    protocol: pydantic.StrictInt
    run: pydantic.constr(strict=True, min_length=1, max_length=64)  # type: ignore[valid-type]
    body: pydantic.conbytes(strict=True, max_length=MAX_MANIFEST_BYTES)  # type: ignore[valid-type]


class RoundRecord(pydantic.BaseModel):
    round: pydantic.conint(strict=True, ge=0)  # type: ignore[valid-type]
    started: pydantic.StrictFloat
    period_s: pydantic.confloat(strict=True, gt=0)  # type: ignore[valid-type]


class PeerRecord(pydantic.BaseModel):
    name: pydantic.constr(strict=True, max_length=MAX_NAME_CHARS)  # type: ignore[valid-type]
    link_class: pydantic.constr(strict=True, regex="^(high|low|slow)$")  # type: ignore[valid-type]
    up_mbps: pydantic.confloat(strict=True, ge=0) | None  # type: ignore[valid-type]
    down_mbps: pydantic.confloat(strict=True, ge=0) | None  # type: ignore[valid-type]
    rtt_ms: pydantic.confloat(strict=True, ge=0) | None  # type: ignore[valid-type]
    mem_gb: pydantic.confloat(strict=True, ge=0)  # type: ignore[valid-type]
    device: pydantic.constr(strict=True, regex="^(cpu|cuda)$")  # type: ignore[valid-type]
    tflops: pydantic.confloat(strict=True, ge=0)  # type: ignore[valid-type]
    wants: pydantic.constr(strict=True, regex="^(anchor|stage|idle)$")  # type: ignore[valid-type]
    role: pydantic.constr(strict=True, regex="^(anchor|stage|idle|coordinator|offline)$")  # type: ignore[valid-type]
    chain: pydantic.constr(strict=True, max_length=64) | None  # type: ignore[valid-type]
    stage: pydantic.conint(strict=True, ge=0, le=1024) | None  # type: ignore[valid-type]
    layers: pydantic.conlist(pydantic.conint(strict=True, ge=0), min_items=2, max_items=2) | None  # type: ignore[valid-type]
    outer_step: pydantic.conint(strict=True, ge=0)  # type: ignore[valid-type]
    last_seen: pydantic.StrictFloat
    version: pydantic.StrictInt
    params_round: pydantic.conint(strict=True, ge=-1) | None  # type: ignore[valid-type]
    layer_digests: dict[ShardName, Digest] | None  # type: ignore[valid-type]
    tokens: pydantic.conint(strict=True, ge=0) | None  # type: ignore[valid-type]


class AnnounceRecord(pydantic.BaseModel):
    """A replica's payload for `round` is ready: the sha256 of each shard's message, the tokens behind it."""

    round: pydantic.conint(strict=True, ge=0)  # type: ignore[valid-type]
    shards: dict[ShardName, Sha256]  # type: ignore[valid-type]
    tokens: pydantic.conint(strict=True, ge=0)  # type: ignore[valid-type]
    steps: pydantic.conint(strict=True, ge=0)  # type: ignore[valid-type]


class Contribution(pydantic.BaseModel):
    peer: pydantic.constr(strict=True, min_length=1, max_length=128)  # type: ignore[valid-type]
    shards: dict[ShardName, Sha256]  # type: ignore[valid-type]
    tokens: pydantic.conint(strict=True, ge=0)  # type: ignore[valid-type]


class SealRecord(pydantic.BaseModel):
    """The sealer's list of the contributions in `round`; every replica aggregates exactly these."""

    round: pydantic.conint(strict=True, ge=0)  # type: ignore[valid-type]
    contributions: pydantic.conlist(Contribution, max_items=1024)  # type: ignore[valid-type]
    excluded: pydantic.conlist(pydantic.constr(strict=True, max_length=128), max_items=1024)  # type: ignore[valid-type]
    sealed_at: pydantic.StrictFloat


class RunRecords(pydantic.BaseModel):
    manifest: dict[BytesWithPublicKey, ManifestRecord]
    round: dict[BytesWithPublicKey, RoundRecord]
    peers: dict[BytesWithPublicKey, PeerRecord]
    announce: dict[BytesWithPublicKey, AnnounceRecord]
    seal: dict[BytesWithPublicKey, SealRecord]


def run_schema_validator(run: str) -> SchemaValidator:
    return SchemaValidator(RunRecords, allow_extra_keys=False, prefix=run)


def record_key(run: str, field: str) -> str:
    if field not in RunRecords.__fields__:
        raise ValueError(f"unknown record field {field!r}")
    return f"{run}_{field}"


def check_peer_record(value: dict) -> dict:
    """Validate a record read from the DHT again on our side (relays may run other code)."""
    return PeerRecord.parse_obj(value).dict()
