"""`export --from URL` against a coordinator URL that an attacker controls: a real HTTP server on 127.0.0.1
answers as the attacker would. Its manifest names the user's own files (leak), a model of 200,000 layers
or an endless body (flood), a byte every few tenths of a second (drip), JSON nested past the recursion
limit and other malformed answers (nest). Each ends in one line, within the user's budgets, and nothing
local is read or written on the stranger's say. What asking again will not mend (a malformed or oversized
answer) is a RefusedAnswer and exits 2; what may pass (the deadline, a stall, a body cut short, a 5xx)
exits 1."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from hetnode.cli.main import main
from hetnode.config import replace
from hetnode.errors import CheckpointError, RefusedAnswer
from hetnode.export.source import fetch_checkpoint
from hetnode.replica.checkpoint import FORMAT, config_hash
from hetnode.service import http_download as download

Answer = Callable[[BaseHTTPRequestHandler], None]
MANIFEST, WEIGHTS, TOKENIZER = (
    f"/api/checkpoint/{n}" for n in ("manifest.json", "model.safetensors", "tokenizer.json")
)


class Attacker:
    """A real HTTP server whose routes write their own answers; `asked` counts requests by path."""

    def __init__(self, routes: dict[str, Answer]) -> None:
        self.routes, self.asked = routes, dict.fromkeys(routes, 0)
        attacker = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 (the http.server name)
                attacker.asked[self.path] = attacker.asked.get(self.path, 0) + 1
                answer = attacker.routes.get(self.path, reply(b"", status=404))
                with contextlib.suppress(OSError):  # the client hung up on us: as it should
                    answer(self)
                self.close_connection = True

            def log_message(self, *args: object) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        threading.Thread(target=self.server.serve_forever, args=(0.05,), daemon=True).start()
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def attacker() -> Iterator[Callable[[dict[str, Answer]], Attacker]]:
    started: list[Attacker] = []

    def start(routes: dict[str, Answer]) -> Attacker:
        started.append(Attacker(routes))
        return started[-1]

    yield start
    for one in started:
        one.close()


def reply(body: bytes, status: int = 200, length: int | None = -1) -> Answer:
    """`body` with a Content-Length of its size (-1), of `length`, or none (None)."""

    def answer(handler: BaseHTTPRequestHandler) -> None:
        handler.send_response(status)
        if length is not None:
            handler.send_header("Content-Length", str(len(body) if length == -1 else length))
        handler.end_headers()
        handler.wfile.write(body)

    return answer


def served(folder: Path) -> dict[str, Answer]:
    return {
        MANIFEST: reply((folder / "manifest.json").read_bytes()),
        WEIGHTS: reply((folder / "model.safetensors").read_bytes()),
    }


def manifest_of(config: dict) -> bytes:
    doc = {"format": FORMAT, "round": 7, "seal_hash": None, "layer_digests": {}, "config": config}
    return json.dumps(doc | {"config_hash": config_hash(config)}).encode()


def one_line_error(exc: pytest.ExceptionInfo) -> str:
    text = str(exc.value)
    assert "\n" not in text and text.isprintable() and len(text) <= 500, repr(text)
    return text


# -- leak: a manifest naming the user's own files ------------------------------------------------------

LEAK_SCRIPT = r"""
import json, os, sys
private, out = sys.argv[1], sys.argv[2]
phase, touched = ["export"], []

def hook(event, args):  # every open, listing and scan of the private folder, by any code in this process
    if event in ("open", "os.listdir", "os.scandir", "os.walk", "glob.glob") and args:
        path = args[0]
        if isinstance(path, (str, bytes, os.PathLike)) and os.fsdecode(path).startswith(private):
            touched.append([phase[0], os.fsdecode(path)])

sys.addaudithook(hook)
from hetnode.cli.main import main
codes = []
for argv in json.loads(sys.argv[3]):
    codes.append(main(argv))
phase[0] = "control"  # the hook sees what it should: this process's own read of the canary
open(os.path.join(private, "canary.txt")).close()
with open(out, "w") as f:
    json.dump({"codes": codes, "touched": touched}, f)
"""


@pytest.mark.slow  # the CLI in a process of its own, with an audit hook
def test_a_manifest_naming_local_files_gets_nothing_read_or_written(
    small, write_checkpoint, attacker, bpe_path: Path, tmp_path: Path
):
    """The attacker's run trains a BPE on `dir:~/private-notes` and caches into `~/public_html`: export and
    sample refuse without a tokenizer from the coordinator (or --tokenizer), and with one they use it; in no
    case is a file of the private folder opened or listed, nor anything written into the data dir."""
    home = tmp_path / "home"
    private = home / "private-notes"
    private.mkdir(parents=True)
    (private / "canary.txt").write_text("the user's secret canary 7f3a\n" * 200)
    lines = [json.dumps({"text": f"private diary entry {i}: canary 7f3a"}) for i in range(300)]
    (private / "diary.jsonl").write_text("\n".join(lines) + "\n")
    config = replace(
        small("none", tied=False, tokenizer="bpe"),
        "data",
        source="dir:~/private-notes",
        data_dir="~/public_html/hetnode",
    )
    folder = write_checkpoint(config)
    without = attacker(served(folder))
    with_tokenizer = attacker(served(folder) | {TOKENIZER: reply(bpe_path.read_bytes())})
    runs = [
        ["export", "--from", without.url, "--out", str(tmp_path / "a")],
        ["sample", "--from", without.url, "--prompt", "dear diary", "--tokens", "4"],
        ["export", "--from", with_tokenizer.url, "--out", str(tmp_path / "b")],
    ]
    result = tmp_path / "result.json"
    done = subprocess.run(
        [sys.executable, "-c", LEAK_SCRIPT, str(private), str(result), json.dumps(runs)],
        capture_output=True,
        timeout=120,
        env=os.environ | {"HOME": str(home)},
    )
    stderr = done.stderr.decode(errors="replace")
    assert done.returncode == 0, stderr
    report = json.loads(result.read_text())
    assert report["codes"] == [1, 1, 0], stderr
    errors = [line for line in stderr.splitlines() if line.startswith("hetnode: ")]
    assert len(errors) == 2 and all("--tokenizer" in e and "BPE" in e for e in errors), stderr
    assert "Traceback" not in stderr
    assert report["touched"] == [["control", str(private / "canary.txt")]]  # the hook works; export never
    assert not (home / "public_html").exists()
    assert (tmp_path / "b" / "tokenizer.json").read_text() == bpe_path.read_text()  # the served one, as is
    assert without.asked[WEIGHTS] == 0  # the missing tokenizer stops it before the weights


def test_a_served_tokenizer_that_does_not_fit_the_model_is_refused(
    small, write_checkpoint, attacker, bpe_path
):
    config = replace(small("none", tied=False, tokenizer="bpe"), "data", source="dir:~/private-notes")
    big = json.loads(bpe_path.read_text())
    big["model"]["vocab"] |= {f"extra{i}": 300 + i for i in range(100)}  # 400 ids, the model has 320
    for body, why in [
        (json.dumps(big).encode(), "more than the model's 320"),
        (b"[" * 50_000, "not a tokenizer JSON file"),
        (json.dumps({"model": {"type": "WordPiece"}}).encode(), "not a BPE tokenizer"),
        (b"\xff" * 100, "not a tokenizer JSON file"),
    ]:
        url = attacker(served(write_checkpoint(config)) | {TOKENIZER: reply(body)}).url
        with pytest.raises(RefusedAnswer) as refused:
            fetch_checkpoint(url, timeout_s=10)
        assert why in one_line_error(refused)


# -- flood: more bytes than the user allows --------------------------------------------------------------


def test_a_config_of_200000_layers_is_refused_before_the_weights(small, attacker):
    raw = small("none", tied=False).to_dict()
    raw["model"] |= {"n_layers": 200_000, "d_model": 1024, "n_heads": 8, "ffn_hidden": 2816}
    flood = attacker({MANIFEST: reply(manifest_of(raw)), WEIGHTS: reply(b"\0" * (8 << 20))})
    with pytest.raises(RefusedAnswer) as refused:
        fetch_checkpoint(flood.url, timeout_s=10)
    assert "--max-download-mb 4096" in one_line_error(refused) and "implies" in str(refused.value)
    assert flood.asked[WEIGHTS] == 0


def test_the_users_cap_bounds_an_honest_checkpoint_too(small, write_checkpoint, attacker):
    url = attacker(served(write_checkpoint(small("none", tied=False)))).url  # ~0.6 MB of weights
    with pytest.raises(RefusedAnswer, match="more than --max-download-mb 1 leaves room for"):
        fetch_checkpoint(url, timeout_s=10, max_bytes=1 << 20)
    assert fetch_checkpoint(url, timeout_s=10, max_bytes=2 << 20).manifest.round == 7


def endless(length: int | None) -> Answer:
    """Headers (declaring `length`, or no length), then zeros until the client hangs up."""

    def answer(handler: BaseHTTPRequestHandler) -> None:
        handler.send_response(200)
        if length is not None:
            handler.send_header("Content-Length", str(length))
        handler.end_headers()
        while True:  # until the write fails: the client hung up
            handler.wfile.write(b"\0" * 65536)

    return answer


@pytest.mark.parametrize("length", [160 << 30, None], ids=["declares-160-GB", "no-length"])
def test_an_endless_body_stops_at_the_limit(small, write_checkpoint, attacker, length, tmp_path):
    folder = write_checkpoint(small("none", tied=False))
    flood = attacker(served(folder) | {WEIGHTS: endless(length)})
    started = time.monotonic()
    with pytest.raises(RefusedAnswer) as refused:
        fetch_checkpoint(flood.url, timeout_s=10)
    assert "allowed" in one_line_error(refused) and time.monotonic() - started < 5
    if length is not None:  # refused on the header: before a byte of the body
        assert f"answer of {length:,} bytes" in str(refused.value)


# -- drip: a byte at a time, each within any per-read timeout ---------------------------------------------


def drip(head: bytes, body_length: int) -> Answer:
    """`head` (status line and headers) and then a body of `body_length`, one byte every 0.2 s."""

    def answer(handler: BaseHTTPRequestHandler) -> None:
        for byte in [*head, *b"x" * body_length]:
            handler.wfile.write(bytes([byte]))
            handler.wfile.flush()
            time.sleep(0.2)

    return answer


@pytest.mark.parametrize("where", ["headers", "body"])
def test_a_drip_ends_at_the_deadline(small, write_checkpoint, attacker, where, tmp_path, capsys):
    folder = write_checkpoint(small("none", tied=False))
    size = (folder / "model.safetensors").stat().st_size
    head = b"HTTP/1.0 200 OK\r\nContent-Length: %d\r\n\r\n" % size
    slow = drip(head, size) if where == "body" else drip(b"HTTP/1.0 200 OK\r\n" + b"X-Pad: y\r\n" * 1000, 0)
    url = attacker(served(folder) | {WEIGHTS: slow}).url
    started = time.monotonic()
    code = main(["export", "--from", url, "--timeout", "1.5", "--out", str(tmp_path / "out")])
    assert code == 1 and time.monotonic() - started < 4
    err = capsys.readouterr().err.strip()
    assert err.endswith("not done within --timeout 1.5 s") and err.count("\n") == 0, err


def test_a_stalled_read_may_pass_and_exits_1(
    small, write_checkpoint, attacker, monkeypatch, tmp_path, capsys
):
    """Headers, then silence: after READ_TIMEOUT_S (shortened here) a plain CheckpointError, not a refusal."""
    monkeypatch.setattr(download, "READ_TIMEOUT_S", 0.3)
    folder = write_checkpoint(small("none", tied=False))

    def stall(handler: BaseHTTPRequestHandler) -> None:
        handler.wfile.write(b"HTTP/1.0 200 OK\r\nContent-Length: 1000\r\n\r\n")
        handler.wfile.flush()
        time.sleep(2)  # the body never comes (within the client's patience)

    url = attacker(served(folder) | {WEIGHTS: stall}).url
    with pytest.raises(CheckpointError, match="sent nothing for 0.3 s") as stalled:
        fetch_checkpoint(url, timeout_s=10)
    assert not isinstance(stalled.value, RefusedAnswer)
    assert main(["export", "--from", url, "--out", str(tmp_path / "out")]) == 1
    assert "sent nothing" in capsys.readouterr().err


# -- nest and other malformed answers ------------------------------------------------------------------------


def good_config(small) -> dict:
    return small("none", tied=False).to_dict()


MALFORMED = {
    "nested-past-the-limit": lambda small: b"[" * 100_000 + b"]" * 100_000,
    "nested-object": lambda small: b'{"a":' * 100_000 + b"1" + b"}" * 100_000,
    "not-utf8": lambda small: b'{"format": "\xff\xfe"}',
    "a-list": lambda small: b"[1, 2, 3]",
    "round-as-text": lambda small: manifest_of(good_config(small)).replace(b'"round": 7', b'"round": "7"'),
    "5000-digit-number": lambda small: b'{"format": "hetnode-checkpoint/1", "round": ' + b"9" * 5000 + b"}",
    "nested-config": lambda small: manifest_of(
        good_config(small) | {"deep": json.loads("[" * 500 + "]" * 500)}
    ),
    "config-key-with-escapes": lambda small: manifest_of(good_config(small) | {"\x1b[2J\nhetnode: ok": 1}),
    "n_layers-as-text": lambda small: manifest_of(
        good_config(small) | {"model": good_config(small)["model"] | {"n_layers": "many"}}
    ),
}


@pytest.mark.parametrize("body", MALFORMED.values(), ids=MALFORMED.keys())
def test_a_malformed_manifest_is_one_line(small, attacker, body, capsys, tmp_path):
    url = attacker({MANIFEST: reply(body(small))}).url
    with pytest.raises(RefusedAnswer) as refused:
        fetch_checkpoint(url, timeout_s=10)
    assert one_line_error(refused).startswith(url)
    assert main(["sample", "--from", url, "--prompt", "x"]) == 2  # asking again gets the same: no restart
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(f"hetnode: {url}"), err


@pytest.mark.parametrize(
    ("answer", "why", "code"),
    [
        (reply(b"0123456789", length=1000), "cut short (10 of 1,000 bytes)", 1),  # transport: may pass
        (reply(b"0123456789", length=None), "not a safetensors file", 2),
        (
            lambda h: h.wfile.write(b"HTTP/1.0 200 OK\r\nContent-Length: 5, 5\r\n\r\n12345"),
            "Content-Length",
            2,
        ),
        (lambda h: h.wfile.write(b"HTTP/1.0 302 Found\r\nLocation: http://10.0.0.1/\r\n\r\n"), "HTTP 302", 2),
        (lambda h: h.wfile.write(b"SSH-2.0-OpenSSH_9.6\r\n"), "not an HTTP answer", 2),
        (reply(b'{"error": "no"}', status=403), "HTTP 403 no", 2),
        (reply(b'{"error": "slow down"}', status=429), "HTTP 429 slow down", 1),
        (
            reply(b'{"error": "\\u001b[31mrewriting\\u001b[0m\\nretry"}', status=500),
            "HTTP 500 [31mrewriting",
            1,
        ),
    ],
    ids=["short", "junk", "two-lengths", "redirect", "not-http", "403", "429", "escapes-in-error"],
)
def test_malformed_weights_are_one_line(
    small, write_checkpoint, attacker, answer, why, code, capsys, tmp_path
):
    """Each failure is one line; the exit code says whether asking again may help (1) or not (2)."""
    url = attacker(served(write_checkpoint(small("none", tied=False))) | {WEIGHTS: answer}).url
    with pytest.raises(CheckpointError) as refused:
        fetch_checkpoint(url, timeout_s=10)
    assert why in one_line_error(refused)
    assert isinstance(refused.value, RefusedAnswer) == (code == 2)
    assert main(["export", "--from", url, "--out", str(tmp_path / "out")]) == code
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("hetnode: ") and err.strip().isprintable(), err
