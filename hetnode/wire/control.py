"""Control messages between daemons (ping, info, bandwidth probe, payload and state fetches, nudges) and the
frame header they travel in.

A frame is a 4-byte big-endian length and that many bytes; a control message is one msgpack map
`{"type": str, "v": int, ...}`. Decoding treats the bytes as hostile: the length is checked against the
limit before anything is read, the map must have exactly the fields of its type with the right types
and ranges, and anything else raises `WireError` naming the field.
"""

from __future__ import annotations

import math
import struct
from dataclasses import dataclass
from typing import Any

import msgpack

from hetnode.errors import WireError

CONTROL_VERSION = 1
HEADER_BYTES = 4
MAX_CONTROL_BYTES = 64 * 1024  # control messages are small; only probe data frames are large
MAX_TEXT_CHARS = 512


def frame_header(length: int) -> bytes:
    return struct.pack(">I", length)


def parse_frame_header(header: bytes, max_bytes: int) -> int:
    """The payload length announced by a frame header, refused before reading when over `max_bytes`."""
    if len(header) != HEADER_BYTES:
        raise WireError("frame", f"header is {len(header)} bytes, expected {HEADER_BYTES}")
    (length,) = struct.unpack(">I", header)
    if length > max_bytes:
        raise WireError("frame", f"frame of {length} bytes exceeds the limit of {max_bytes}")
    return length


_Schema = dict[str, tuple[type, float | None]]

# type -> {field: (python type, lower bound or None)}; every field is required, no others allowed.
_REQUESTS: dict[str, _Schema] = {
    "ping": {},
    "info": {},
    "probe_up": {"bytes": (int, 1)},
    "probe_down": {"bytes": (int, 1), "seconds": (float, 0.0)},
    "payload": {"round": (int, 0), "shard": (str, None), "replica": (str, None)},
    "state": {"round": (int, 0), "shard": (str, None)},
    # a leaving stage's error feedback for `shard`, asked by the spare that took its stage (answered with
    # payload_ready and one dense fp32 payload frame, or refused to anyone else)
    "feedback": {"shard": (str, None)},
    # the spare has every shard of that feedback, checked (answered with ack): the leaver may exit now;
    # until then it stays, so that a transfer its exit would cut can be asked again
    "feedback_taken": {},
    # was the asker's payload in the seal of `round`? (a replica that missed that seal settles its
    # error feedback: a payload that never reached θ goes back into it)
    "included": {"round": (int, 0)},
    # "look now": an announcement (to a sealer) or a seal (to replicas) of `round` is in the DHT
    "nudge": {"round": (int, 0), "about": (str, None)},
    # the answerer's own current entry of a round-protocol `field`, straight from it: the path beside the
    # DHT, which nodes with chosen ids next to the run's keys could otherwise hide (answered with
    # payload_ready and one frame: {"value", "expires"})
    "own": {"field": (str, None)},
    # a closed run: an admission for the caller's key, for a join token ("" for an allowlisted key)
    "admit": {"token": (str, None)},
    # "can you open a TCP connection to my libp2p port?": answered by dialling that port at the address
    # the asker's connection comes from (never at an address the asker names)
    "dialback": {"port": (int, 1)},
}
# what a peer that is not a member of a closed run may still ask (to find the run, get admitted and learn
# whether it can be dialled)
OPEN_TO_STRANGERS = ("ping", "info", "admit", "dialback")
LONG_TEXT_CHARS = {"token": 2048, "admission": 2048}  # signed texts (`hetnode.wire.admission`)
NUDGE_TOPICS = ("announce", "seal")
DIRECT_FIELDS = ("manifest", "peers", "announce", "seal", "head")  # what an "own" request may ask for
_REPLIES: dict[str, _Schema] = {
    "pong": {"time": (float, None)},
    "info": {
        "run": (str, None),
        "protocol": (int, 0),
        "coordinator": (str, None),
        "role": (str, None),
        "name": (str, None),
    },
    "probe_ready": {"bytes": (int, 0)},
    "probe_result": {"bytes": (int, 0), "seconds": (float, 0.0)},
    "payload_ready": {"bytes": (int, 0)},  # then one frame of that many bytes
    "admitted": {"admission": (str, None)},
    "inclusion": {"round": (int, 0), "answer": (str, None)},  # "yes", "no" or "unknown"
    "dialed": {"port": (int, 0), "answer": (str, None)},  # "yes", "no" or "unknown" (no address to dial)
    "ack": {},
    "error": {"code": (str, None), "message": (str, None)},
}


@dataclass(frozen=True)
class ControlMessage:
    type: str
    fields: dict[str, Any]

    def __getitem__(self, key: str) -> Any:
        return self.fields[key]


def encode_request(message_type: str, **fields: Any) -> bytes:
    return _encode(message_type, fields, _REQUESTS)


def encode_reply(message_type: str, **fields: Any) -> bytes:
    return _encode(message_type, fields, _REPLIES)


def _encode(message_type: str, fields: dict[str, Any], schemas: dict[str, _Schema]) -> bytes:
    schema = schemas.get(message_type)
    if schema is None:
        raise ValueError(f"unknown control message type {message_type!r}")
    if set(fields) != set(schema):
        raise ValueError(f"{message_type} needs fields {sorted(schema)}, got {sorted(fields)}")
    return msgpack.packb({"type": message_type, "v": CONTROL_VERSION, **fields}, use_bin_type=True)


def decode_request(data: bytes, max_probe_bytes: int) -> ControlMessage:
    message = _decode(data, _REQUESTS)
    if message.type in ("probe_up", "probe_down") and message["bytes"] > max_probe_bytes:
        raise WireError("bytes", f"probe of {message['bytes']} bytes exceeds the limit of {max_probe_bytes}")
    if message.type == "nudge" and message["about"] not in NUDGE_TOPICS:
        raise WireError("about", f"expected one of {NUDGE_TOPICS}, got {message['about']!r:.40}")
    if message.type == "own" and message["field"] not in DIRECT_FIELDS:
        raise WireError("field", f"expected one of {DIRECT_FIELDS}, got {message['field']!r:.40}")
    return message


def decode_reply(data: bytes) -> ControlMessage:
    return _decode(data, _REPLIES)


def _decode(data: bytes, schemas: dict[str, _Schema]) -> ControlMessage:
    if len(data) > MAX_CONTROL_BYTES:
        raise WireError("message", f"{len(data)} bytes exceeds the control limit of {MAX_CONTROL_BYTES}")
    try:
        raw = msgpack.unpackb(
            data, raw=False, strict_map_key=True, max_bin_len=0, max_array_len=64, max_map_len=16
        )
    except Exception as exc:  # msgpack raises several unrelated types on garbage
        raise WireError("message", f"not a msgpack message: {type(exc).__name__}") from None
    if not isinstance(raw, dict):
        raise WireError("message", f"expected a map, got {type(raw).__name__}")
    message_type = raw.get("type")
    if message_type not in schemas:
        raise WireError("type", f"unknown message type {message_type!r}")
    if raw.get("v") != CONTROL_VERSION:
        raise WireError("v", f"unsupported version {raw.get('v')!r}, this daemon speaks {CONTROL_VERSION}")
    schema = schemas[message_type]
    extra = set(raw) - set(schema) - {"type", "v"}
    if extra:
        raise WireError(sorted(extra)[0], "unexpected field")
    fields = {}
    for name, (kind, lower) in schema.items():
        if name not in raw:
            raise WireError(name, "missing")
        value = raw[name]
        if kind is float and isinstance(value, int) and not isinstance(value, bool):
            value = float(value)
        if not isinstance(value, kind) or isinstance(value, bool):
            raise WireError(name, f"expected {kind.__name__}, got {type(value).__name__}")
        if isinstance(value, float) and not math.isfinite(value):
            raise WireError(name, "not finite")
        limit = LONG_TEXT_CHARS.get(name, MAX_TEXT_CHARS)
        if isinstance(value, str) and len(value) > limit:
            raise WireError(name, f"longer than {limit} characters")
        if lower is not None and value < lower:
            raise WireError(name, f"must be >= {lower}, got {value}")
        fields[name] = value
    return ControlMessage(type=message_type, fields=fields)
