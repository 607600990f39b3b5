"""The DHT record schemas of a run. hivemind's SchemaValidator enforces them on every node that stores
or relays a record; RSASignatureValidator makes `[owner:...]` subkeys writable only by their owner.

Keys (hivemind prefixes them as `{run}_{field}`):
- `manifest`: subkey = the coordinator's owner key; a small versioned envelope around the msgpack body,
  so that a daemon of another protocol version can still read it and refuse with a clear message.
- `round`: subkey = the coordinator's owner key; the current boundary (outer step) number.
- `peers`: subkey = each peer's owner key; what the peer says about itself.
- `head`: subkey = the coordinator's owner key; the round its θ is at and that θ's layer digests, what
  every replica checks its own against after a round. A key of its own, so that the check reads one small
  entry instead of every peer's record. It also carries the digest of the coordinator's view of the swarm
  (`directory`) and when it was stored (`at`): a peer whose own view has that digest need not read every
  record again (`PeerDirectory`).
- `changes`: subkey = the coordinator's owner key; its view's recent transitions (digest to digest, with the
  records of the peers that changed), stored before the head that names the newest digest: a replica one or
  a few changes behind applies them instead of reading every record (`hetnode/protocol/view_changes.py`).

Every field has a lifetime cap (`MAX_TTL_S`) and a size cap (`MAX_RECORD_BYTES`), enforced by
`RecordCapsValidator` where a record is stored and again where it is read (docs/security.md, "Exhaust a
daemon"): without them one seal with a 10-year expiry stays forever, and a handful of huge records push a key
past hivemind's reply limit so that fresh readers see no entries at all.

hivemind answers a DHT get in one unary p2pd message of at most 4 MiB (`DEFAULT_MAX_MSG_SIZE = 4 * 1024**2`
in hivemind/p2p/p2p_daemon_bindings/control.py, the persistent connection's limit; a larger answer comes
back as "response size exceeds message size limit", i.e. no entries). One `peers` entry at its cap weighs
~4.9 KB in a reply (a 4 KiB value, a 356-byte RSA-2048 signature, a 391-byte owner subkey), so ~860 live
peers fit in one reply; a real `1b` record (20 shard digests) is ~1.55 KB there, ~2,700 of them fit.
`announce` has the same cap and the same count; `seal` and `manifest` have one or a few writers.
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable
from typing import Any

import pydantic.v1 as pydantic
from hivemind.dht.routing import DHTID
from hivemind.dht.schema import BytesWithPublicKey, SchemaValidator
from hivemind.dht.validation import DHTRecord, RecordValidatorBase
from hivemind.utils import MSGPackSerializer

from hetnode.net.identity import peer_id_of_subkey
from hetnode.wire.seals import MAX_SEAL_WEIGHT

MAX_NAME_CHARS = 64
ShardName = pydantic.constr(strict=True, regex=r"^(embed|head|[0-9]{1,4})$")
Digest = pydantic.constr(strict=True, regex=r"^[0-9a-f]{8,64}$")
Sha256 = pydantic.constr(strict=True, regex=r"^[0-9a-f]{64}$")
MAX_MANIFEST_BYTES = 64 * 1024
MAX_SHARDS = 1026  # 1024 layers, embed and head: the most shards a dict keyed by ShardName may have

# Callers stay well under these: peers record_ttl_s (30 s in configs/), announce 300 s, manifest 600 s,
# round 4 x boundary_s (120 s by default), seal, head and changes 3600 s.
MAX_TTL_S: dict[str, float] = {
    "manifest": 900.0,
    "round": 300.0,
    "peers": 120.0,
    "announce": 600.0,
    "seal": 7200.0,
    "head": 7200.0,
    "changes": 7200.0,
}
# msgpack bytes of the value. Real records (1b config, 18 layers): peers ~0.8 KB, announce ~1.4 KB,
# manifest ~1.2 KB, round ~50 B; a seal holds ~1.46 KB per contribution of all 20 shards, ~179 of them.
MAX_RECORD_BYTES: dict[str, int] = {
    "peers": 4 * 1024,
    "announce": 4 * 1024,
    "seal": 256 * 1024,
    "manifest": MAX_MANIFEST_BYTES + 1024,  # the schema's largest body and its envelope
    "round": 256,
    "head": 4 * 1024,  # the digests of a peer record, which has the same cap
    # a few steps of changed peer records (~0.8-1.5 KB each): the coordinator drops its oldest steps to fit
    "changes": 64 * 1024,
}
TTL_SLACK_S = 30.0  # honest peers' clocks disagree by seconds
COORDINATOR_FIELDS = ("head", "changes", "manifest")  # entries only the run's coordinator writes
SEALER_FIELDS = ("seal",)  # entries only the coordinator and the manifest's stand-ins write
OWNER = re.compile(rb"\[owner:(.+?)\]")  # hivemind's owner marker, inside the serialised subkey
SIGNATURE_BYTES = 512  # RSASignatureValidator's "[signature:<base64>]" suffix: 356 bytes for RSA-2048
MAX_SUBKEY_BYTES = 1024  # "[owner:<ssh-rsa key>]" in msgpack: 391 bytes for RSA-2048


def _at_most(limit: int, what: str) -> Callable[[Any], Any]:
    """A pre-validator that refuses a list or dict on its length alone, before its items are validated."""

    def check(value: Any) -> Any:
        if isinstance(value, (dict, list)) and len(value) > limit:
            raise ValueError(f"{len(value)} {what}, at most {limit}")
        return value

    return check


def _at_most_shards(value: Any) -> Any:
    # before the items are validated: a dict of 10^5 shards is refused on its length alone
    if isinstance(value, dict) and len(value) > MAX_SHARDS:
        raise ValueError(f"{len(value)} shards, at most {MAX_SHARDS}")
    return value


class ManifestRecord(pydantic.BaseModel):
    protocol: pydantic.StrictInt
    run: pydantic.constr(strict=True, min_length=1, max_length=64)  # type: ignore[valid-type]
    body: pydantic.conbytes(strict=True, max_length=MAX_MANIFEST_BYTES)  # type: ignore[valid-type]


class RoundRecord(pydantic.BaseModel):
    round: pydantic.conint(strict=True, ge=0)  # type: ignore[valid-type]
    started: pydantic.StrictFloat
    period_s: pydantic.confloat(strict=True, gt=0)  # type: ignore[valid-type]


# "peer:first-last" (a string: hivemind's schema check refuses any type conversion, list -> tuple included)
ChainMember = pydantic.constr(strict=True, regex=r"^[1-9A-HJ-NP-Za-km-z]{1,128}:[0-9]{1,4}-[0-9]{1,4}$")
PeerIdText = pydantic.constr(strict=True, regex=r"^[1-9A-HJ-NP-Za-km-z]{1,128}$")
MAX_NOSHOWS = 8  # spares a broken chain's member names as planned into its successor and never claiming it
MAX_TOKENS = (
    2**40
)  # per record or announcement: far above any round (H × batch × sequence), far below overflow
MAX_STEPS = 2**20
MAX_ROUND_S = 86400.0  # a day: the most a round's training may last or claim


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
    # the whole chain (peer, first layer, last layer) per stage, which the chain's name commits to
    chain_layout: pydantic.conlist(ChainMember, max_items=64) | None = None  # type: ignore[valid-type]
    # a successor chain's lineage (the name its chain was founded under), which its name commits to
    chain_lineage: pydantic.constr(strict=True, max_length=64) | None = None  # type: ignore[valid-type]
    # this member's training in its chain ended (a neighbour left or misbehaved): continue it at the boundary
    chain_broken: pydantic.StrictBool | None = None
    # the member whose frame failed our checks (no honest stage sends it): the chain goes on without it
    chain_blame: pydantic.constr(strict=True, max_length=128) | None = None  # type: ignore[valid-type]
    # spares the plan put into our broken chain's successor that never claimed it: not planned there again
    chain_noshows: pydantic.conlist(PeerIdText, max_items=MAX_NOSHOWS) | None = None  # type: ignore[valid-type]
    # a closed run: the coordinator's signed admission of this peer (`hetnode.wire.admission`)
    admission: pydantic.constr(strict=True, max_length=2048) | None = None  # type: ignore[valid-type]
    outer_step: pydantic.conint(strict=True, ge=0)  # type: ignore[valid-type]
    last_seen: pydantic.StrictFloat
    version: pydantic.StrictInt
    params_round: pydantic.conint(strict=True, ge=-1) | None  # type: ignore[valid-type]
    layer_digests: dict[ShardName, Digest] | None  # type: ignore[valid-type]
    tokens: pydantic.conint(strict=True, ge=0, le=MAX_TOKENS) | None  # type: ignore[valid-type]
    # a replica's compute utilisation over its last rounds (seconds in inner steps / wall seconds,
    # `hetnode.service.round_log.rolling_utilization`): advice for people, nothing decides on it
    utilization: pydantic.confloat(strict=True, ge=0, le=1) | None = None  # type: ignore[valid-type]
    # paced rounds: seconds this replica needs for its floor of inner steps (its measured pace); the
    # budget rises to let it in, never past what the fastest need for their cap (`RoundBudget`)
    floor_s: pydantic.confloat(strict=True, gt=0, le=MAX_ROUND_S) | None = None  # type: ignore[valid-type]

    _cap_digests = pydantic.validator("layer_digests", pre=True, allow_reuse=True)(_at_most_shards)


class AnnounceRecord(pydantic.BaseModel):
    """A replica's payload for `round` is ready: the sha256 of each shard's message, the tokens behind it."""

    round: pydantic.conint(strict=True, ge=0)  # type: ignore[valid-type]
    shards: dict[ShardName, Sha256]  # type: ignore[valid-type]
    tokens: pydantic.conint(strict=True, ge=0, le=MAX_TOKENS)  # type: ignore[valid-type]
    steps: pydantic.conint(strict=True, ge=0, le=MAX_STEPS)  # type: ignore[valid-type]
    # seconds the replica spent in those steps (paced rounds learn their budget from it; absent: unknown)
    train_s: pydantic.confloat(strict=True, ge=0, le=MAX_ROUND_S) | None = None  # type: ignore[valid-type]

    _cap_shards = pydantic.validator("shards", pre=True, allow_reuse=True)(_at_most_shards)


class Contribution(pydantic.BaseModel):
    peer: pydantic.constr(strict=True, min_length=1, max_length=128)  # type: ignore[valid-type]
    shards: dict[ShardName, Sha256]  # type: ignore[valid-type]
    tokens: pydantic.conint(strict=True, ge=0, le=MAX_TOKENS)  # type: ignore[valid-type]
    # its weight in the aggregate, earned by verified history (absent in seals of older sealers: 1)
    weight: pydantic.conint(strict=True, ge=1, le=MAX_SEAL_WEIGHT) | None = None  # type: ignore[valid-type]
    # the inner steps behind it (paced rounds: its batches and its credit; absent: the manifest's H)
    steps: pydantic.conint(strict=True, ge=0, le=MAX_STEPS) | None = None  # type: ignore[valid-type]

    _cap_shards = pydantic.validator("shards", pre=True, allow_reuse=True)(_at_most_shards)


class SealRecord(pydantic.BaseModel):
    """The sealer's list of the contributions in `round`; every replica aggregates exactly these."""

    round: pydantic.conint(strict=True, ge=0)  # type: ignore[valid-type]
    contributions: pydantic.conlist(Contribution, max_items=1024)  # type: ignore[valid-type]
    excluded: pydantic.conlist(pydantic.constr(strict=True, max_length=128), max_items=1024)  # type: ignore[valid-type]
    sealed_at: pydantic.StrictFloat
    prev: pydantic.constr(strict=True, regex=r"^([0-9a-f]{64})?$")  # type: ignore[valid-type]  # the seal before
    # paced rounds: the seconds of training a round gets from now on (absent: a round is H steps)
    budget_s: pydantic.confloat(strict=True, gt=0, le=MAX_ROUND_S) | None = None  # type: ignore[valid-type]


class HeadRecord(pydantic.BaseModel):
    """The coordinator's θ: the last round applied to it and its layer digests after that round."""

    round: pydantic.conint(strict=True, ge=-1)  # type: ignore[valid-type]
    layer_digests: dict[ShardName, Digest]  # type: ignore[valid-type]
    # the digest of who is in the swarm in which role as the coordinator reads it (SwarmView), and the
    # coordinator's clock when it stored this entry; absent in entries of older coordinators
    directory: pydantic.constr(strict=True, regex=r"^[0-9a-f]{16}$") | None = None  # type: ignore[valid-type]
    at: pydantic.confloat(strict=True, ge=0, le=1e11) | None = None  # type: ignore[valid-type]
    # the newest round it sealed: a replica waiting for a seal polls this small entry, not the seal
    sealed: pydantic.conint(strict=True, ge=-1) | None = None  # type: ignore[valid-type]

    _cap_digests = pydantic.validator("layer_digests", pre=True, allow_reuse=True)(_at_most_shards)


PeerId = pydantic.constr(strict=True, regex=r"^[1-9A-HJ-NP-Za-km-z]{1,128}$")
ViewDigest = pydantic.constr(strict=True, regex=r"^[0-9a-f]{16}$")
MAX_CHANGE_STEPS = 8  # steps the coordinator keeps: a replica further behind reads every record
MAX_STEP_PEERS = 64  # peers one step may name: a larger change is not logged (readers read every record)


class ChangeStep(pydantic.BaseModel):
    """One transition of the coordinator's view: the records of the peers whose decision fields differ
    between the view of digest `from` and the view of digest `to` (None: the peer left)."""

    from_: ViewDigest = pydantic.Field(alias="from")  # type: ignore[valid-type]
    to: ViewDigest  # type: ignore[valid-type]
    peers: dict[PeerId, PeerRecord | None]  # type: ignore[valid-type]

    _cap_peers = pydantic.validator("peers", pre=True, allow_reuse=True)(_at_most(MAX_STEP_PEERS, "peers"))


class ChangesRecord(pydantic.BaseModel):
    """The coordinator's recent view transitions, newest last, and its clock when it stored them."""

    steps: list[ChangeStep]
    at: pydantic.confloat(strict=True, ge=0, le=1e11)  # type: ignore[valid-type]

    _cap_steps = pydantic.validator("steps", pre=True, allow_reuse=True)(_at_most(MAX_CHANGE_STEPS, "steps"))


class RunRecords(pydantic.BaseModel):
    manifest: dict[BytesWithPublicKey, ManifestRecord]
    round: dict[BytesWithPublicKey, RoundRecord]
    peers: dict[BytesWithPublicKey, PeerRecord]
    announce: dict[BytesWithPublicKey, AnnounceRecord]
    seal: dict[BytesWithPublicKey, SealRecord]
    head: dict[BytesWithPublicKey, HeadRecord]
    changes: dict[BytesWithPublicKey, ChangesRecord]

    def dict(self, **kwargs: Any) -> dict[str, Any]:  # type: ignore[override]
        """hivemind's schema check compares this with the stored value and refuses any difference: an
        optional field a record leaves out (one added later, e.g. a seal's `budget_s`) must stay out."""
        kwargs.setdefault("exclude_unset", True)
        return super().dict(**kwargs)


DIRECT_MODELS: dict[str, type[pydantic.BaseModel]] = {
    "manifest": ManifestRecord,
    "peers": PeerRecord,
    "announce": AnnounceRecord,
    "seal": SealRecord,
    "head": HeadRecord,
}


def run_schema_validator(run: str) -> SchemaValidator:
    return SchemaValidator(RunRecords, allow_extra_keys=False, prefix=run)


def record_key(run: str, field: str) -> str:
    if field not in RunRecords.__fields__:
        raise ValueError(f"unknown record field {field!r}")
    return f"{run}_{field}"


def check_peer_record(value: dict) -> dict:
    """Validate a record read from the DHT again on our side (relays may run other code)."""
    return PeerRecord.parse_obj(value).dict()


def check_head_record(value: Any) -> dict:
    """The same for the coordinator's `head` entry."""
    return HeadRecord.parse_obj(value).dict()


def check_changes_record(value: Any) -> dict:
    """The same for the coordinator's `changes` entry (its steps keyed `from`, as stored)."""
    return ChangesRecord.parse_obj(value).dict(by_alias=True)


def check_direct_entry(field: str, value: Any) -> None:
    """Raise unless `value` is a valid entry of `field` by the run's schema: for an entry a peer handed
    us itself (`SwarmNode.read_direct`), which no DHT node has validated."""
    model = DIRECT_MODELS[field]
    if not isinstance(value, dict) or not set(value) <= set(model.__fields__):
        raise ValueError(f"not a {field} entry")
    model.parse_obj(value)


def value_bytes(value: Any) -> int:
    """The msgpack bytes of a record's value, as the size caps count them."""
    return len(MSGPackSerializer.dumps(value))


class RecordCapsValidator(RecordValidatorBase):
    """Refuses a record of `run` that would live longer, or weighs more, than its field's cap, an entry of
    a coordinator-only field (`head`, `changes`, `manifest`) by anyone but `coordinator` (when known), and
    a `seal` by anyone but the coordinator and the `sealers` its manifest lists (once they are known).

    It runs before the signature check (a higher priority), so an over-cap record costs a comparison, not
    an RSA verification and a msgpack decode. hivemind validates what it reads as well: a relay that
    holds an over-cap entry (it runs other code) has its whole answer for that key dropped, as it would
    for a forged signature.

    Readers only ever take the coordinator's entry of `head` and `changes`, so strangers' entries there
    are never useful; without this rule a thousand identities could each store one and push the key past
    hivemind's reply limit (64 KiB `changes` entries: sixty-odd identities), which would cost every
    replica the cheap refreshes and seal polls these keys exist for."""

    def __init__(
        self, run: str, clock: Callable[[], float] = time.time, coordinator: str | None = None
    ) -> None:
        self.clock = clock
        self.coordinator = coordinator  # None: not known yet (any writer, as for other fields)
        self.sealers: frozenset[str] | None = None  # the manifest's stand-ins; None: not known yet
        self._fields = {DHTID.generate(source=record_key(run, f)).to_bytes(): f for f in MAX_TTL_S}
        self._writers: dict[bytes, str | None] = {}  # owner subkey -> its peer id (an RSA key to hash)

    def validate(self, record: DHTRecord) -> bool:
        field = self._fields.get(record.key)
        if field is None:
            return True  # not a key of the run: the schema validator decides
        if record.expiration_time > self.clock() + MAX_TTL_S[field] + TTL_SLACK_S:
            return False
        if len(record.subkey or b"") > MAX_SUBKEY_BYTES:
            return False
        if len(record.value) > MAX_RECORD_BYTES[field] + SIGNATURE_BYTES:
            return False
        if field in COORDINATOR_FIELDS:
            return self.coordinator is None or self._writer(record.subkey or b"") == self.coordinator
        if field in SEALER_FIELDS and self.coordinator is not None and self.sealers is not None:
            return self._writer(record.subkey or b"") in self.sealers | {self.coordinator}
        return True

    def _writer(self, subkey: bytes) -> str | None:
        if subkey not in self._writers:
            if len(self._writers) > 1024:  # strangers' keys: each costs one hash, never unbounded memory
                self._writers.clear()
            owners = OWNER.findall(subkey)
            self._writers[subkey] = peer_id_of_subkey(b"[owner:" + owners[0] + b"]") if owners else None
        return self._writers[subkey]

    @property
    def priority(self) -> int:
        return 20  # RSASignatureValidator is 10; validation runs from the highest priority down


def cap_problem(field: str, value: Any, expiration_time: float, now: float) -> str | None:
    """Why an entry read from the DHT breaks its field's caps, or None. Checked again on read: the
    entry may come from our own storage or a path that skipped the validator."""
    if expiration_time > now + MAX_TTL_S[field] + TTL_SLACK_S:
        return f"expires in {expiration_time - now:.0f} s, beyond the {MAX_TTL_S[field]:.0f} s cap"
    size = value_bytes(value)
    if size > MAX_RECORD_BYTES[field]:
        return f"{size} bytes, over the {MAX_RECORD_BYTES[field]}-byte cap"
    return None


def new_head_record(
    round_: int, layer_digests: dict[str, str], directory: str | None, sealed: int | None = None
) -> dict[str, Any]:
    """The coordinator's `head` entry: its θ's round and digests, the digest of its view of the swarm
    (None before its first read), the newest round it sealed (at least θ's), stamped with its clock now."""
    sealed = max(round_, sealed if sealed is not None else round_)
    return {
        "round": round_,
        "layer_digests": layer_digests,
        "directory": directory,
        "at": time.time(),
        "sealed": sealed,
    }


def new_changes_record(steps: list[dict[str, Any]]) -> dict[str, Any]:
    """The coordinator's `changes` entry: `steps` (`{"from", "to", "peers"}`, newest last), stamped with its
    clock now."""
    return {"steps": steps, "at": time.time()}


# a record's chain fields when its peer holds no stage
NO_CHAIN: dict[str, Any] = {
    "chain": None,
    "stage": None,
    "layers": None,
    "chain_layout": None,
    "chain_lineage": None,
    "chain_broken": None,
    "chain_blame": None,
    "chain_noshows": None,
}


def new_peer_record(name: str, **fields: Any) -> dict[str, Any]:
    """A complete peer record (hivemind's schema check wants every field, even the nulls): an idle peer
    whose link is not measured yet, with `fields` changed."""
    unknown = set(fields) - set(PeerRecord.__fields__)
    if unknown:
        raise ValueError(f"not peer record fields: {sorted(unknown)}")
    record: dict[str, Any] = {
        "name": name,
        "link_class": "slow",
        "up_mbps": None,
        "down_mbps": None,
        "rtt_ms": None,
        "mem_gb": 0.0,
        "device": "cpu",
        "tflops": 0.0,
        "wants": "idle",
        "role": "idle",
        **NO_CHAIN,
        "outer_step": 0,
        "last_seen": time.time(),
        "version": 1,
        "params_round": None,
        "layer_digests": None,
        "tokens": None,
        "admission": None,
        "utilization": None,
    }
    return record | fields
