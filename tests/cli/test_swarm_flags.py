"""The join and status flags as a user meets them: --help names every flag's meaning, a bad flag's error
names the flag once and the fix, link rates print as people write them."""

from __future__ import annotations

import math

import pytest

from hetnode.cli.main import EXIT_USAGE, build_parser, config_error_text, main
from hetnode.daemon.status import render_table
from hetnode.errors import ConfigError
from hetnode.service.formatting import format_mbit

PEER_ID = "QmYyQSo1c1Ym7orWxLYvCrM2EmxFTANf8wXmmE7DWjhx5N"


@pytest.mark.parametrize(
    ("rate", "text"),
    [
        (1000.0, "1000"),
        (1e6 - 1, "999999"),
        (12_500.4, "12500"),
        (100.0, "100"),
        (99.95, "100"),  # rounds up: still no exponent
        (20.0, "20"),
        (12.34, "12.3"),
        (2.5, "2.5"),
        (0.25, "0.25"),
        (0.5, "0.5"),
        (0.004, "<0.01"),
        (0, "0"),
        (None, "-"),
        (True, "-"),
        ("fast", "-"),
        (-1.0, "-"),
        (math.inf, "-"),
        (math.nan, "-"),
    ],
)
def test_link_rates_print_readably(rate, text):
    assert format_mbit(rate) == text
    assert "e+" not in format_mbit(rate) and "e-" not in format_mbit(rate)


def test_the_status_table_prints_a_gigabit_link_without_an_exponent():
    document = {
        "run": "r",
        "config": "tiny",
        "round": 1,
        "coordinator": PEER_ID,
        "peers": [{"name": "fast", "peer_id": PEER_ID, "up_mbps": 1000.0, "down_mbps": 2500.0}],
        "chains": [],
    }
    row = render_table(document).split("\n")[3]
    assert " 1000 " in row and " 2500 " in row and "e+" not in row


def test_a_flag_error_names_the_flag_once():
    text = config_error_text(ConfigError("--bandwidth", "bandwidth", "expected 'auto' or Mbit/s, got 'x'"))
    assert text == "--bandwidth: expected 'auto' or Mbit/s, got 'x'"
    from_file = config_error_text(ConfigError("configs/x.toml", "model.dim", "must be > 0"))
    assert from_file == "config error: configs/x.toml: model.dim: must be > 0"


@pytest.mark.parametrize(
    ("value", "words"),
    [
        ("fast", "expected 'auto' or Mbit/s, got 'fast'"),
        ("1e9", "must be above 0 and below 1000000 Mbit/s, got 1e9"),
    ],
)
def test_a_bad_bandwidth_is_refused_naming_the_flag_once(capsys, value, words):
    argv = ["join", "--peer", f"/ip4/127.0.0.1/tcp/1/p2p/{PEER_ID}", "--bandwidth", value]
    assert main(argv) == EXIT_USAGE
    err = capsys.readouterr().err
    assert f"hetnode: --bandwidth: {words}" in err and "bandwidth: bandwidth" not in err


@pytest.mark.parametrize("command", [["join"], ["status"]])
@pytest.mark.parametrize("peer", ["/ip4/127.0.0.1/tcp/1", "127.0.0.1:8400", "QmNotAnAddress"])
def test_a_bad_peer_is_told_both_forms_and_the_wait(capsys, command, peer):
    assert main([*command, "--peer", peer]) == EXIT_USAGE  # an argument error: restarting will not mend it
    err = capsys.readouterr().err
    assert "/p2p/<peer id>" in err and "http://HOST:PORT" in err and "--http-port" in err
    assert ("--connect-timeout" if command == ["join"] else "--timeout") in err


@pytest.mark.parametrize("url", ["http://", "http://127.0.0.1:99999", "http://127.0.0.1:0"])
def test_a_bad_coordinator_url_is_refused_before_anything_starts(capsys, url):
    assert main(["status", "--peer", url]) == EXIT_USAGE
    err = capsys.readouterr().err
    assert url in err and "http://HOST:PORT" in err


@pytest.mark.parametrize(
    ("argv", "flag"),
    [
        (["join", "--connect-timeout", "0"], "--connect-timeout"),
        (["join", "--connect-timeout", "nan"], "--connect-timeout"),
        (["status", "--timeout", "-1"], "--timeout"),
    ],
)
def test_a_wait_that_cannot_end_or_never_starts_is_refused(capsys, argv, flag):
    assert main([*argv, "--peer", f"/ip4/127.0.0.1/tcp/1/p2p/{PEER_ID}"]) == EXIT_USAGE
    assert f"hetnode: {flag}: must be in" in capsys.readouterr().err


def _help(command: str) -> str:
    commands = next(a for a in build_parser()._actions if a.dest == "command")
    return " ".join(commands.choices[command].format_help().split())  # argparse wraps lines


def test_join_help_explains_every_flag_a_user_sets():
    text = _help("join")
    for words in (
        "--role {auto,anchor,stage} auto (default)",
        "--device {cpu,cuda} where this peer trains",
        "--connect-timeout SECONDS how long to wait for --peer",
        "http://HOST:PORT",
    ):
        assert words in text, words


def test_status_help_explains_the_timeout_and_both_peer_forms():
    text = _help("status")
    assert "--timeout SECONDS give up after this long" in text
    assert "http://HOST:PORT" in text and "READY line" in text
