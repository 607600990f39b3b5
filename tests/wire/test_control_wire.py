"""Control messages, frame headers, the manifest envelope: hostile bytes get a WireError naming the field."""

import random
import struct
from pathlib import Path

import msgpack
import pytest

from hetnode.config import load_config
from hetnode.errors import WireError
from hetnode.wire.control import (
    MAX_CONTROL_BYTES,
    decode_reply,
    decode_request,
    encode_reply,
    encode_request,
    frame_header,
    parse_frame_header,
)
from hetnode.wire.manifest import PROTOCOL_VERSION, Manifest, ProtocolMismatch, manifest_from_envelope

MAX_PROBE = 4 * 2**20


def test_requests_and_replies_round_trip():
    assert decode_request(encode_request("ping"), MAX_PROBE).type == "ping"
    probe = decode_request(encode_request("probe_down", bytes=1000, seconds=2.0), MAX_PROBE)
    assert (probe.type, probe["bytes"], probe["seconds"]) == ("probe_down", 1000, 2.0)
    info = decode_reply(encode_reply("info", run="r", protocol=1, coordinator="Qm", role="anchor", name="a"))
    assert info["role"] == "anchor"
    nudge = decode_request(encode_request("nudge", round=7, about="seal"), MAX_PROBE)
    assert (nudge.type, nudge["round"], nudge["about"]) == ("nudge", 7, "seal")


def _packed(**fields):
    return msgpack.packb(fields, use_bin_type=True)


@pytest.mark.parametrize(
    ("data", "field"),
    [
        (random.Random(0).randbytes(64), "message"),  # fixed garbage: the same test ids in every process
        (b"", "message"),
        (_packed(type="ping"), "v"),
        (_packed(type="shutdown", v=1), "type"),
        (msgpack.packb([1, 2, 3]), "message"),
        (_packed(type="ping", v=1, extra=1), "extra"),
        (_packed(type="probe_up", v=1), "bytes"),
        (_packed(type="probe_up", v=1, bytes="many"), "bytes"),
        (_packed(type="probe_up", v=1, bytes=True), "bytes"),
        (_packed(type="probe_up", v=1, bytes=0), "bytes"),
        (_packed(type="probe_up", v=1, bytes=MAX_PROBE + 1), "bytes"),
        (_packed(type="probe_down", v=1, bytes=10, seconds=float("nan")), "seconds"),
        (_packed(type="probe_down", v=1, bytes=10, seconds=-1.0), "seconds"),
        (b"\x00" * (MAX_CONTROL_BYTES + 1), "message"),
        (_packed(type="nudge", v=1, round=3, about="shutdown"), "about"),
        (_packed(type="nudge", v=1, round=-1, about="seal"), "round"),
    ],
)
def test_hostile_requests_are_refused_with_the_field(data, field):
    with pytest.raises(WireError) as caught:
        decode_request(data, MAX_PROBE)
    assert caught.value.field == field


def test_replies_are_checked_too():
    with pytest.raises(WireError, match="text|characters"):
        decode_reply(_packed(type="error", v=1, code="x", message="y" * 10_000))
    with pytest.raises(WireError):
        decode_reply(_packed(type="pong", v=1, time="now"))


def test_frame_header_limit_is_checked_before_reading():
    assert parse_frame_header(frame_header(100), 100) == 100
    with pytest.raises(WireError, match="exceeds"):
        parse_frame_header(struct.pack(">I", 2**31), 1024)
    with pytest.raises(WireError, match="header"):
        parse_frame_header(b"\x00\x01", 1024)


def test_encoders_refuse_wrong_fields():
    with pytest.raises(ValueError):
        encode_request("probe_up")
    with pytest.raises(ValueError):
        encode_reply("nonsense")


@pytest.fixture(scope="module")
def tiny():
    return load_config(Path(__file__).resolve().parents[2] / "configs" / "tiny.toml")


def test_manifest_round_trip(tiny):
    manifest = Manifest(PROTOCOL_VERSION, "tiny-1", tiny, 12.5)
    assert manifest_from_envelope(manifest.envelope()) == manifest


def test_manifest_of_another_version_is_refused_clearly(tiny):
    envelope = Manifest(PROTOCOL_VERSION + 1, "tiny-1", tiny, 1.0).envelope()
    with pytest.raises(ProtocolMismatch, match=f"version {PROTOCOL_VERSION + 1}.*upgrade hetnode"):
        manifest_from_envelope(envelope)
    older = Manifest(PROTOCOL_VERSION - 1, "tiny-1", tiny, 1.0).envelope()
    with pytest.raises(ProtocolMismatch, match="older hetnode"):
        manifest_from_envelope(older)


def test_manifest_body_is_validated(tiny):
    good = Manifest(PROTOCOL_VERSION, "tiny-1", tiny, 1.0).envelope()
    with pytest.raises(WireError, match="manifest.body"):
        manifest_from_envelope(dict(good, body=b"\xc1garbage"))
    bad_config = tiny.to_dict()
    bad_config["model"]["n_layers"] = -1
    body = msgpack.packb({"config": bad_config, "created": 1.0}, use_bin_type=True)
    with pytest.raises(WireError, match="n_layers"):
        manifest_from_envelope(dict(good, body=body))
    with pytest.raises(WireError, match="protocol"):
        manifest_from_envelope({"run": "x"})
