"""Opening a checkpoint from a coordinator URL: a real HTTP server on 127.0.0.1 serves a checkpoint folder
the way the coordinator does (`/api/checkpoint/manifest.json`, `/api/checkpoint/model.safetensors`, and a BPE
run's `/api/checkpoint/tokenizer.json`). Attacks on the client are in `test_source_attacks.py`."""

from __future__ import annotations

import contextlib
import json
import socket
import threading
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import torch

from hetnode.cli.main import main
from hetnode.config import replace
from hetnode.data.tokenizer import BpeTokenizer
from hetnode.errors import CheckpointError, ConfigError, RefusedAnswer
from hetnode.export.source import fetch_checkpoint, open_checkpoint, run_tokenizer

# path -> (status, body, send Content-Length); a callable is asked again on every request
Reply = tuple[int, bytes, bool]
Routes = dict[str, Reply | Callable[[], Reply]]


@pytest.fixture
def serve() -> Iterator[Callable[[Routes], str]]:
    servers: list[ThreadingHTTPServer] = []

    def start(routes: Routes) -> str:
        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 (the http.server name)
                route = routes.get(self.path)
                status, body, length = (route() if callable(route) else route) if route else (404, b"", True)
                self.send_response(status)
                if length:
                    self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                with contextlib.suppress(
                    BrokenPipeError, ConnectionResetError
                ):  # the client refused the rest
                    self.wfile.write(body)
                self.close_connection = True

            def log_message(self, *args: object) -> None:
                pass

        server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        servers.append(server)
        threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True).start()
        return f"http://127.0.0.1:{server.server_address[1]}"

    yield start
    for server in servers:
        server.shutdown()
        server.server_close()


def _routes(folder: Path) -> Routes:
    return {
        "/api/checkpoint/manifest.json": (200, (folder / "manifest.json").read_bytes(), True),
        "/api/checkpoint/model.safetensors": (200, (folder / "model.safetensors").read_bytes(), True),
    }


def test_url_gives_what_the_folder_holds(small, write_checkpoint, serve):
    folder = write_checkpoint(small("selective", tied=True))
    url = serve(_routes(folder))
    from_url, from_folder = open_checkpoint(url + "/"), open_checkpoint(str(folder))
    assert from_url.manifest == from_folder.manifest and from_url.config == from_folder.config
    assert from_url.params.keys() == from_folder.params.keys()
    assert all(torch.equal(from_url.params[n], t) for n, t in from_folder.params.items())


def test_export_from_a_url(small, write_checkpoint, serve, tmp_path: Path):
    folder = write_checkpoint(small("none", tied=False))
    out = tmp_path / "hf"
    assert main(["export", "--from", serve(_routes(folder)), "--format", "hf", "--out", str(out)]) == 0
    provenance = json.loads((out / "config.json").read_text())["hetnode"]
    assert provenance["round"] == 7 and provenance["run"] == "test-run"


def test_unreachable_url_is_a_clear_error(tmp_path: Path, capsys):
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    with pytest.raises(CheckpointError, match="cannot reach the coordinator") as unreachable:
        fetch_checkpoint(f"http://127.0.0.1:{port}", timeout_s=5)
    assert not isinstance(unreachable.value, RefusedAnswer)  # it may come up: exit 1, a service restarts
    assert main(["export", "--from", f"http://127.0.0.1:{port}", "--out", str(tmp_path / "o")]) == 1
    assert "cannot reach" in capsys.readouterr().err


def test_no_checkpoint_yet_is_a_404(serve, tmp_path: Path):
    with pytest.raises(CheckpointError, match="HTTP 404.*no checkpoint here"):
        fetch_checkpoint(serve({}), timeout_s=5)
    said = json.dumps({"error": "no checkpoint yet: the coordinator writes one every K rounds"}).encode()
    url = serve({"/api/checkpoint/manifest.json": (404, said, True)})
    with pytest.raises(CheckpointError, match="HTTP 404 no checkpoint yet: the coordinator writes") as none:
        fetch_checkpoint(url, timeout_s=5)
    assert not isinstance(none.value, RefusedAnswer)  # one will be written: exit 1, asking later may help
    assert main(["export", "--from", url, "--out", str(tmp_path / "o")]) == 1


def test_a_busy_coordinator_is_asked_again(small, write_checkpoint, serve):
    """503 while the coordinator rewrites its checkpoints: retried, then the checkpoint arrives."""
    folder = write_checkpoint(small("none", tied=False))
    routes = _routes(folder)
    answers = iter([(503, b'{"error": "checkpoints are being rewritten; retry"}', True)])
    weights = routes["/api/checkpoint/model.safetensors"]
    routes["/api/checkpoint/model.safetensors"] = lambda: next(answers, weights)
    assert fetch_checkpoint(serve(routes), timeout_s=5).manifest.round == 7


@pytest.mark.parametrize("declared", [True, False], ids=["content-length", "no-length"])
def test_oversized_manifest_is_refused(serve, declared: bool):
    big = json.dumps({"format": "hetnode-checkpoint/1", "pad": "x" * (5 << 20)}).encode()
    url = serve({"/api/checkpoint/manifest.json": (200, big, declared)})
    with pytest.raises(RefusedAnswer, match="allowed"):
        fetch_checkpoint(url, timeout_s=5)


@pytest.mark.parametrize("declared", [True, False], ids=["content-length", "no-length"])
def test_weights_larger_than_the_config_implies_are_refused(small, write_checkpoint, serve, declared):
    folder = write_checkpoint(small("none", tied=False))
    routes = _routes(folder)
    weights = (folder / "model.safetensors").read_bytes()
    routes["/api/checkpoint/model.safetensors"] = (200, weights + b"\0" * (2 << 20), declared)
    with pytest.raises(RefusedAnswer, match="allowed"):
        fetch_checkpoint(serve(routes), timeout_s=5)


def test_a_manifest_that_is_not_json_is_refused(serve, tmp_path: Path, capsys):
    url = serve({"/api/checkpoint/manifest.json": (200, b"<html>status page</html>", True)})
    with pytest.raises(RefusedAnswer, match="not a JSON manifest"):
        fetch_checkpoint(url, timeout_s=5)
    assert main(["export", "--from", url, "--out", str(tmp_path / "o")]) == 2  # the same on every try
    err = capsys.readouterr().err
    assert err.startswith(f"hetnode: {url}") and "not a JSON manifest" in err and err.count("\n") == 1


def test_weights_of_another_round_are_fetched_again(small, write_checkpoint, serve):
    """A checkpoint written between the two requests: the pair disagrees once, the retry gets a match."""
    config = small("none", tied=False)
    old, new = write_checkpoint(config, round_=3), write_checkpoint(config, round_=4)
    manifests = iter([old, new])  # first the old manifest, then (retry) the new one
    routes: Routes = {
        "/api/checkpoint/manifest.json": lambda: (
            200,
            (next(manifests) / "manifest.json").read_bytes(),
            True,
        ),
        "/api/checkpoint/model.safetensors": (200, (new / "model.safetensors").read_bytes(), True),
    }
    assert fetch_checkpoint(serve(routes), timeout_s=5).manifest.round == 4


def test_damaged_weights_are_refused(small, write_checkpoint, serve):
    folder = write_checkpoint(small("none", tied=False))
    routes = _routes(folder)
    weights = bytearray((folder / "model.safetensors").read_bytes())
    weights[-4] ^= 1  # the lowest mantissa bit of the last value: only the layer digests see it
    routes["/api/checkpoint/model.safetensors"] = (200, bytes(weights), True)
    with pytest.raises(RefusedAnswer, match="digests"):
        fetch_checkpoint(serve(routes), timeout_s=5)


@pytest.mark.parametrize(
    "url", ["http://", "http://127.0.0.1:1/?x=1", "http://127.0.0.1:99999", "http://[::1", "http://h/a b"]
)
def test_malformed_urls_are_usage_errors(url: str, tmp_path: Path, capsys):
    with pytest.raises(ConfigError):
        open_checkpoint(url)
    assert main(["export", "--from", url, "--out", str(tmp_path / "o")]) == 2
    assert capsys.readouterr().err.startswith("hetnode: --from: ")


def test_a_url_of_another_scheme_is_a_folder_name():
    with pytest.raises(ConfigError, match="no such file or folder"):
        open_checkpoint("ftp://127.0.0.1:1")


def test_a_crowded_coordinator_is_asked_again_with_backoff(small, write_checkpoint, serve):
    """503 four times (every download slot taken): asked again, sooner first, then the checkpoint arrives."""
    folder = write_checkpoint(small("none", tied=False))
    routes = _routes(folder)
    busy = (503, b'{"error": "too many downloads at once; retry later"}', True)
    answers, weights = iter([busy] * 4), routes["/api/checkpoint/model.safetensors"]
    routes["/api/checkpoint/model.safetensors"] = lambda: next(answers, weights)
    assert fetch_checkpoint(serve(routes), timeout_s=20).manifest.round == 7


def _bpe_config(small):
    return replace(small("none", tied=False, tokenizer="bpe"), "data", source="dir:/nonexistent/corpus")


def test_a_bpe_runs_tokenizer_comes_with_the_checkpoint(small, write_checkpoint, serve, bpe_path, tmp_path):
    folder = write_checkpoint(_bpe_config(small))
    routes = _routes(folder)
    bare = serve(dict(routes))  # a coordinator that serves no tokenizer
    routes["/api/checkpoint/tokenizer.json"] = (200, bpe_path.read_bytes(), True)
    url = serve(routes)
    checkpoint = fetch_checkpoint(url, timeout_s=5)
    ours = BpeTokenizer.load(bpe_path, "bpe-test")
    text = "the old river runs north, number 12. Ünïcödé"
    assert run_tokenizer(checkpoint).encode(text) == ours.encode(text)

    with pytest.raises(CheckpointError, match=r"HTTP 404 no tokenizer here.*pass --tokenizer FILE") as none:
        fetch_checkpoint(bare, timeout_s=5)
    assert not isinstance(none.value, RefusedAnswer)  # a coordinator may still be building it
    mine = fetch_checkpoint(bare, timeout_s=5, with_tokenizer=False)  # the user brings it: none is asked for
    assert mine.tokenizer is None and run_tokenizer(mine, bpe_path).encode(text) == ours.encode(text)
    with pytest.raises(CheckpointError, match="pass --tokenizer FILE"):
        run_tokenizer(mine)  # never rebuilt from a stranger's data config
    out = tmp_path / "hf"
    assert main(["export", "--from", bare, "--tokenizer", str(bpe_path), "--out", str(out)]) == 0
    assert (out / "tokenizer.json").read_text() == bpe_path.read_text()


def test_a_local_checkpoint_takes_the_tokenizer_kept_beside_it(small, write_checkpoint, bpe_path):
    """The coordinator's checkpoints/ folder holds tokenizer.json: used as it is, no data source opened."""
    folder = write_checkpoint(_bpe_config(small))
    (folder.parent / "tokenizer.json").write_bytes(bpe_path.read_bytes())
    for source in (folder, folder.parent):
        tokenizer = run_tokenizer(open_checkpoint(str(source)))
        assert tokenizer.vocab_size == 300 and tokenizer.encode("the river") == BpeTokenizer.load(
            bpe_path, "x"
        ).encode("the river")
