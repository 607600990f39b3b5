"""`hetnode status` prints peer-chosen strings: no terminal escape sequence, control or bidi character may
reach the terminal, and ordinary names in any script still read as written."""

from __future__ import annotations

import random
import unicodedata

import pytest

import hetnode.daemon.status as status
from hetnode.cli.main import main
from hetnode.daemon.status import printable, render_table

PEER_ID = "12D3KooWGRUVh2RNnvh6dquqNn6K7Tq4b1q2nZMB4RVtYfF7bKoF"

HOSTILE = [
    ("\x1b[31mred\x1b[0m", "red"),
    ("\x1b]0;title\x07name", "name"),
    ("\u202eevil\u202c", "evil"),
    ("\x9b31mc1", "c1"),  # the one-character CSI
    ("\x1b]8;;http://evil.example\x1b\\click\x1b]8;;\x1b\\", "click"),  # an OSC 8 hyperlink
    ("a\x1bPdcs payload\x1b\\b", "ab"),
    ("\x1bcreset", "reset"),  # RIS: reset the terminal
    ("\x1b(0line", "line"),  # switch to the line-drawing set
    ("trailing\x1b[", "trailing"),
    ("trailing\x1b]0;never ends", "trailing"),
    ("bell\x07nul\x00del\x7fbs\x08", "bellnuldelbs"),
    ("two\nlines\rback\ttab", "two lines back tab"),
    ("\u2066iso\u2069\u200elrm\u200f\u061c", "isolrm"),
    ("para\u2028graph", "para graph"),
    ("tag\U000e0041\U000e007f", "tag"),
    ("half\ud800", "half\ufffd"),
    ("\x1b\x00[31m", "[31m"),  # what is left cannot form a sequence: no ESC survives
]

NAMES = ["Zoë", "山田太郎", "Ελένη", "مرحبا", "שלום", "क्‍ष", "👨‍👩‍👧", "🦊", "o'brien-2", "naïve café"]


@pytest.mark.parametrize(("text", "expected"), HOSTILE)
def test_printable_strips_sequences_and_controls(text: str, expected: str):
    assert printable(text, 64) == expected


@pytest.mark.parametrize("name", NAMES)
def test_printable_keeps_names_in_any_script(name: str):
    assert printable(name, 64) == name


def test_printable_truncates_with_a_mark():
    assert printable("abcdefghij", 5) == "abcd\u2026"
    assert printable("abcde", 5) == "abcde"
    assert printable("\x1b[1m" * 10 + "ok", 5) == "ok"
    assert printable("\x1b[1m" * 10**5 + "ok", 5) == ""  # absurd input: work is bounded, output safe
    assert printable("anything", 0) == ""
    assert len(printable("x" * 10**6, 16)) == 16


def test_printable_never_lets_a_control_through():
    rng = random.Random(7)
    alphabet = [chr(c) for c in [*range(0, 0x20), 0x7F, *range(0x80, 0xA0), 0x202E, 0x2066, 0x200D]]
    alphabet += list("[]();P^_\\0123abc ") + ["é", "山"]
    for _ in range(2000):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randrange(1, 40)))
        out = printable(text, 24)
        assert len(out) <= 24
        for char in out:
            category = unicodedata.category(char)
            assert category != "Cc" and (category != "Cf" or char == "\u200d"), (text, out)


def hostile_document() -> dict:
    evil = "\x1b]0;pwned\x07\x1b[2J\u202eevil\nname"
    peer = {
        "peer_id": PEER_ID[:-8] + "\x1b[31mABCD",
        "name": evil,
        "class": "\x1b[5mfast",
        "role": "anchor\x1b[8m",
        "chain": "c1-\x1b]8;;x\x07",
        "stage": 0,
        "layers": [0, "\x1b[1m3"],
        "up_mbps": "\x1b[1m",  # not a number: shown as "-"
        "down_mbps": 10.0,
        "params_round": 3,
        "layer_digests": {"embed": "\x9b2Jdeadbeef"},
        "last_seen": 990.0,
    }
    return {
        "run": "run\x1b[2J",
        "config": "cfg\u202e",
        "round": 3,
        "coordinator": PEER_ID,
        "time": 1000.0,
        "peers": [peer, {**peer, "name": "Zoë 山田", "chain": None, "layers": None}],
        "chains": [
            {"id": "c1-\x1b[H", "live": False, "stages": ["\x1b[Kxx", None], "problem": "gone\r\x1b[2K"}
        ],
    }


def assert_safe(text: str) -> None:
    for char in text:
        if char == "\n":
            continue
        category = unicodedata.category(char)
        assert category != "Cc" and category != "Cf", repr(char)


def test_render_table_prints_no_control_characters():
    text = render_table(hostile_document())
    assert_safe(text)
    lines = text.split("\n")
    assert len(lines) == 3 + 2 + 1 + 1  # header, blank, columns, 2 peers, blank, 1 chain: no injected lines
    assert "evil name" in text and "Zoë 山田" in text
    assert lines[0].startswith("run run (cfg), boundary 3, 2 peers")  # boundary t, not a sync round


def test_hetnode_status_text_output_is_sanitised(monkeypatch, capsys):
    async def fake_query(peer: str, timeout_s: float, listen: str, stop: object) -> dict:
        return hostile_document()

    monkeypatch.setattr(status, "query_status", fake_query)
    assert main(["status", "--peer", f"/ip4/127.0.0.1/tcp/1/p2p/{PEER_ID}"]) == 0
    out = capsys.readouterr().out
    assert_safe(out)
    assert "evil name" in out
