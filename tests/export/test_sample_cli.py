"""`hetnode sample` as a user runs it: a real subprocess on a checkpoint folder; its exit codes for a URL."""

from __future__ import annotations

import socket
import subprocess
import sys
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import torch

from hetnode.cli.main import main
from hetnode.data.tokenizer import ByteTokenizer
from hetnode.export.source import load_global_model, open_checkpoint
from hetnode.model.sampling import sample_tokens

PROMPT = "The river"


def _sample(folder: Path, *flags: str) -> str:
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "hetnode.cli.main",
            "sample",
            "--from",
            str(folder),
            "--prompt",
            PROMPT,
            *flags,
        ],
        capture_output=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr.decode(errors="replace")
    assert done.stdout.endswith(b"\n") and done.stdout.startswith(PROMPT.encode())  # the prompt, then more
    return done.stdout[len(PROMPT) : -1].decode("utf-8")  # bytes: text mode would make a sampled "\r" "\n"


@pytest.fixture
def checkpoint(small, write_checkpoint) -> Path:
    return write_checkpoint(small("selective", tied=False))


def test_a_seed_repeats_its_sample_and_greedy_is_the_argmax(checkpoint: Path):
    model = load_global_model(open_checkpoint(str(checkpoint)))
    prompt = ByteTokenizer().encode(PROMPT)

    seeded = _sample(checkpoint, "--tokens", "24", "--temperature", "1.0", "--seed", "3")
    draws = sample_tokens(model, prompt, 24, 1.0, seed=3, stop_id=ByteTokenizer.eos_id)
    assert seeded == ByteTokenizer().decode(draws)  # the same text in another process: seeded
    assert draws != sample_tokens(model, prompt, 24, 1.0, seed=4, stop_id=ByteTokenizer.eos_id)

    greedy = _sample(checkpoint, "--tokens", "24", "--temperature", "0")
    ids, expected = list(prompt), []
    with torch.no_grad():
        for _ in range(24):  # the argmax continuation, step by step, without the sampler
            token = int(model(torch.tensor([ids]))[0, -1].argmax())
            if token == ByteTokenizer.eos_id:
                break
            ids.append(token)
            expected.append(token)
    assert greedy == ByteTokenizer().decode(expected)


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--tokens", "0"], "--tokens"),
        (["--tokens", "4097"], "--tokens"),
        (["--temperature", "-1"], "--temperature"),
        (["--temperature", "nan"], "--temperature"),
        (["--temperature", "inf"], "--temperature"),
        (["--seed", "-1"], "--seed"),
    ],
)
def test_bad_flags_are_usage_errors(checkpoint: Path, flags: list[str], message: str, capsys):
    assert main(["sample", "--from", str(checkpoint), "--prompt", PROMPT, *flags]) == 2
    assert message in capsys.readouterr().err


def test_a_prompt_of_no_tokens_is_a_usage_error(checkpoint: Path, capsys):
    assert main(["sample", "--from", str(checkpoint), "--prompt", ""]) == 2
    assert "encodes to no tokens" in capsys.readouterr().err


def test_sampling_what_is_not_a_checkpoint_exits_2(tmp_path: Path, capsys):
    """Asking again gets the same answer: exit 2, so a systemd unit does not restart it (issue 33, item 5)."""
    assert main(["sample", "--from", str(tmp_path), "--prompt", PROMPT]) == 2
    assert "is not a checkpoint" in capsys.readouterr().err
    assert main(["sample", "--from", "nonsense", "--prompt", PROMPT]) == 2
    assert "nonsense: no such file or folder" in capsys.readouterr().err


@pytest.fixture
def not_a_coordinator() -> Iterator[str]:
    """A web server whose every page is HTML: its `manifest.json` is no JSON, however often it is asked."""

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 (the http.server name)
            body = b"<html>a blog</html>"
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def test_a_url_that_answers_no_checkpoint_exits_2_and_one_unreachable_exits_1(not_a_coordinator, capsys):
    """2 (do not restart) when asking again gets the same answer; 1 when the coordinator may come up."""
    assert main(["sample", "--from", not_a_coordinator, "--prompt", PROMPT]) == 2
    err = capsys.readouterr().err
    assert err.startswith("hetnode: ") and "not a JSON manifest" in err and err.count("\n") == 1
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    assert main(["sample", "--from", f"http://127.0.0.1:{port}", "--prompt", PROMPT, "--timeout", "5"]) == 1
    assert "cannot reach the coordinator" in capsys.readouterr().err
