"""Every config or argument error exits 2, with a message that names the fix.

docs/operations.md tells systemd `RestartPreventExitStatus=2`: exit 2 means "fix it, do not restart", so a
peer with a typo in a flag or a config must not exit 1 and restart forever. This file holds the list (the
doc's table "Exit code 2, by case" mirrors it); each case runs where the error is detected, before any
daemon starts, through `main([...])`; a taken HTTP port, detected by the coordinator, runs as a process.
A `--peer` whose address answers with another peer id needs a live coordinator:
tests/swarm/test_peer_address_answers.py.
"""

from __future__ import annotations

import socket
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from hetnode.cli.main import EXIT_USAGE, main
from hetnode.config import dump_config, load_config, replace

ROOT = Path(__file__).resolve().parents[2]
TINY = ROOT / "configs" / "tiny.toml"
PEER_ID = "12D3KooWGRUVh2RNnvh6dquqNn6K7Tq4b1q2nZMB4RVtYfF7bKoF"
BOTH_FORMS = ("http://HOST:PORT", "/p2p/<peer id>")


def bad_value_config(tmp: Path) -> list[str]:
    text = TINY.read_text().replace("n_heads = 4", "n_heads = 0", 1)
    assert text != TINY.read_text()
    (tmp / "bad.toml").write_text(text)
    return ["train", "--config", str(tmp / "bad.toml"), "--max-steps", "1", "--out", str(tmp / "run")]


def unknown_key_config(tmp: Path) -> list[str]:
    (tmp / "typo.toml").write_text(TINY.read_text().replace("d_model = 128", "d_modle = 128", 1))
    return ["train", "--config", str(tmp / "typo.toml"), "--max-steps", "1", "--out", str(tmp / "run")]


def parquet_without_text_column(tmp: Path) -> list[str]:
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    pq.write_table(pa.table({"body": ["some text"] * 8}), tmp / "docs.parquet")
    config = replace(load_config(TINY), "data", source=f"parquet:{tmp / 'docs.parquet'}", data_dir=str(tmp))
    (tmp / "parquet.toml").write_text(dump_config(config))
    return ["train", "--config", str(tmp / "parquet.toml"), "--max-steps", "1", "--out", str(tmp / "run")]


# (case id, argv maker, words the message must hold)
CASES: list[tuple[str, Callable[[Path], list[str]], tuple[str, ...]]] = [
    ("join --peer host:port", lambda t: ["join", "--peer", "127.0.0.1:31337"], BOTH_FORMS),
    ("status --peer host:port", lambda t: ["status", "--peer", "127.0.0.1:31337"], BOTH_FORMS),
    ("--peer multiaddr without id", lambda t: ["join", "--peer", "/ip4/127.0.0.1/tcp/31337"], BOTH_FORMS),
    ("--peer unknown scheme", lambda t: ["status", "--peer", "ftp://127.0.0.1:8400"], BOTH_FORMS),
    ("--peer URL without host", lambda t: ["status", "--peer", "http://"], ("http://HOST:PORT",)),
    ("--peer URL bad port", lambda t: ["join", "--peer", "http://127.0.0.1:99999"], ("http://HOST:PORT",)),
    (
        "--coordinator not an id",
        lambda t: ["join", "--peer", "http://h:1", "--coordinator", "x"],
        ("--coordinator",),
    ),
    (
        "config file missing",
        lambda t: ["train", "--config", str(t / "nope.toml")],
        ("nope.toml", "no such file"),
    ),
    ("config bad value", bad_value_config, ("bad.toml", "model.n_heads")),
    ("config unknown key", unknown_key_config, ("typo.toml", "d_modle")),
    ("parquet without text column", parquet_without_text_column, ("no column 'text'", "data.text_column")),
    ("train --max-steps 0", lambda t: ["train", "--config", str(TINY), "--max-steps", "0"], ("--max-steps",)),
    ("status --timeout 0", lambda t: ["status", "--peer", "http://h:1", "--timeout", "0"], ("--timeout",)),
    ("join --bandwidth", lambda t: ["join", "--peer", "http://h:1", "--bandwidth", "fast"], ("--bandwidth",)),
    ("bootstrap without --config", lambda t: ["bootstrap", "--data-dir", str(t)], ("--config",)),
    (
        "sample --from missing",
        lambda t: ["sample", "--from", "/nonexistent", "--prompt", "x"],
        ("/nonexistent",),
    ),
    (
        "export --from missing",
        lambda t: ["export", "--from", "/nonexistent", "--out", str(t / "o")],
        ("/nonexistent",),
    ),
]


@pytest.mark.parametrize(("argv", "words"), [(c[1], c[2]) for c in CASES], ids=[c[0] for c in CASES])
def test_a_config_or_argument_error_exits_2_naming_the_fix(argv, words, tmp_path: Path, capsys):
    code = main(argv(tmp_path))
    err = capsys.readouterr().err
    assert code == EXIT_USAGE, err
    for word in words:
        assert word in err, err


def test_an_argparse_error_exits_2_too(capsys):
    with pytest.raises(SystemExit) as exited:
        main(["join"])  # --peer is required
    assert exited.value.code == EXIT_USAGE
    assert "--peer" in capsys.readouterr().err


def test_a_taken_http_port_exits_2_naming_the_flag(tmp_path: Path):
    """The coordinator, a real process: refused before its P2P daemon, its model or its data dir."""
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen(1)
        port = holder.getsockname()[1]
        argv = [sys.executable, "-m", "hetnode.cli.main", "bootstrap", "--config", str(TINY)]
        argv += ["--listen", "/ip4/127.0.0.1/tcp/0", "--data-dir", str(tmp_path / "c")]
        argv += ["--http-port", str(port)]
        done = subprocess.run(argv, capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert done.returncode == EXIT_USAGE, done.stderr
    assert f"port {port} is taken" in done.stderr, done.stderr
    assert "pass --http-port N" in done.stderr and "--http-port off" in done.stderr, done.stderr
    assert not (tmp_path / "c").exists()  # nothing started, nothing written
    assert "READY" not in done.stdout
