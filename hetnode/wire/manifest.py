"""The run manifest: what every daemon must agree on before it takes part (protocol version, run id, the
whole validated run config with its thresholds, limits and seed).

On the DHT it travels as a small envelope `{protocol, run, body}` whose shape never changes, so a daemon
of another version can still read it and refuse with a clear message instead of failing on a schema.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import msgpack

from hetnode.config import Config, config_from_dict
from hetnode.errors import ConfigError, HetnodeError, WireError
from hetnode.wire.admission import MODES, AdmissionMode

PROTOCOL_VERSION = 8  # 2: signed payloads, seal chains, stand-ins; 3: payload base, drift frames, included;
# 4: the head entry carries the coordinator's view digest and clock (every field is required by the DHT)
# 5: the coordinator's `changes` entry (its view's recent steps), a key older nodes' schema refuses
# 6: the peer record's `utilization` (a replica's compute utilisation), a field older nodes' schema refuses
# 7: paced rounds: an announcement's `train_s`, a seal's `budget_s` and each contribution's `steps`, a peer
# record's `floor_s`: fields older nodes' schema refuses
# 8: the drift frame names a θ round (frame version 2): a chain's stages all hold θ's embedding
MAX_BODY_BYTES = 64 * 1024
MAX_STAND_INS = 64
MAX_PEER_ID_CHARS = 128
MAX_KEY_CHARS = 2048


class ProtocolMismatch(HetnodeError):
    """The swarm speaks another protocol version than this daemon."""

    def __init__(self, theirs: int, ours: int) -> None:
        self.theirs = theirs
        self.ours = ours
        advice = (
            "upgrade hetnode"
            if theirs > ours
            else "ask the coordinator to upgrade, or install an older hetnode"
        )
        super().__init__(f"the swarm speaks protocol version {theirs}, this hetnode speaks {ours}: {advice}")


@dataclass(frozen=True)
class Manifest:
    protocol: int
    run: str
    config: Config
    created: float
    # peers that may seal while the coordinator is silent (the operator's choice; docs/security.md, "Who is
    # trusted with what")
    stand_ins: tuple[str, ...] = ()
    admission: AdmissionMode = "open"  # who may take part (`hetnode.wire.admission`)
    coordinator_key: str = ""  # OpenSSH text of the coordinator's public key: it signs admissions

    def envelope(self) -> dict[str, Any]:
        fields = {
            "config": self.config.to_dict(),
            "created": self.created,
            "stand_ins": list(self.stand_ins),
            "admission": self.admission,
            "coordinator_key": self.coordinator_key,
        }
        body = msgpack.packb(fields, use_bin_type=True)
        if len(body) > MAX_BODY_BYTES:
            raise ValueError(f"manifest body of {len(body)} bytes exceeds {MAX_BODY_BYTES}")
        return {"protocol": self.protocol, "run": self.run, "body": body}


def manifest_from_envelope(envelope: Any) -> Manifest:
    """Check the version first, then decode and validate the config inside."""
    if not isinstance(envelope, dict):
        raise WireError("manifest", f"expected a map, got {type(envelope).__name__}")
    protocol = envelope.get("protocol")
    if not isinstance(protocol, int) or isinstance(protocol, bool):
        raise WireError("manifest.protocol", "missing or not an integer")
    if protocol != PROTOCOL_VERSION:
        raise ProtocolMismatch(protocol, PROTOCOL_VERSION)
    run, body = envelope.get("run"), envelope.get("body")
    if not isinstance(run, str) or not run:
        raise WireError("manifest.run", "missing")
    if not isinstance(body, bytes) or len(body) > MAX_BODY_BYTES:
        raise WireError("manifest.body", f"missing or larger than {MAX_BODY_BYTES} bytes")
    try:
        raw = msgpack.unpackb(body, raw=False, strict_map_key=True, max_bin_len=0)
    except Exception as exc:
        raise WireError("manifest.body", f"not msgpack: {type(exc).__name__}") from None
    if not isinstance(raw, dict) or not isinstance(raw.get("config"), dict):
        raise WireError("manifest.body", "no config map")
    created = raw.get("created")
    if not isinstance(created, float):
        raise WireError("manifest.created", "missing or not a float")
    stand_ins = raw.get("stand_ins", [])
    if (
        not isinstance(stand_ins, list)
        or len(stand_ins) > MAX_STAND_INS
        or not all(isinstance(p, str) and 0 < len(p) <= MAX_PEER_ID_CHARS for p in stand_ins)
    ):
        raise WireError("manifest.stand_ins", f"must be a list of at most {MAX_STAND_INS} peer ids")
    admission = raw.get("admission", "open")
    if admission not in MODES:
        raise WireError("manifest.admission", f"expected one of {MODES}, got {admission!r:.40}")
    key = raw.get("coordinator_key", "")
    if not isinstance(key, str) or len(key) > MAX_KEY_CHARS:
        raise WireError("manifest.coordinator_key", f"must be text of at most {MAX_KEY_CHARS} characters")
    try:
        config = config_from_dict(raw["config"], source=f"manifest of run {run}")
    except ConfigError as exc:
        raise WireError("manifest.config", str(exc)) from None
    return Manifest(protocol, run, config, created, tuple(stand_ins), admission, key)
