"""The Makefile's set-up, run for real: it picks a supported Python before it installs anything, and takes
torch's CPU build from PyTorch's index where that index answers, else (quickly: no pip timeout) from the
default index.

Nothing is installed: `make venv VENV=<tmp>/venv` runs the real recipe, but the venv's python is a stand-in
that records each `python -m pip ...` call and runs everything else (the index probe) with this interpreter.
The indexes are loopback servers or names that cannot resolve.
"""

from __future__ import annotations

import http.server
import os
import re
import shutil
import socket
import subprocess
import sys
import threading
import time
import tomllib
from collections.abc import Iterator
from pathlib import Path

import pytest
from packaging.specifiers import SpecifierSet

ROOT = Path(__file__).resolve().parents[1]
Completed = subprocess.CompletedProcess
TORCH = "torch==2.13.0"

pytestmark = [
    pytest.mark.skipif(shutil.which("make") is None, reason="needs make"),
    pytest.mark.skipif(sys.platform != "linux", reason="only Linux takes the CPU index (PyPI's is CUDA)"),
]

RECORDING_PYTHON = f"""#!/bin/sh
if [ "$1" = -m ] && [ "$2" = pip ]; then
    shift 2
    echo "$*" >> "$(dirname "$0")/pip-calls"
    case "$*" in *--index-url*) exit "${{FAKE_INDEX_INSTALL_RC:-0}}";; esac
    exit 0
fi
exec {sys.executable} "$@"
"""


def write_script(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    path.chmod(0o755)
    return path


def make_venv(tmp_path: Path, *args: str, env: dict[str, str] | None = None) -> tuple[Completed, float]:
    """Run `make venv` into tmp_path/venv; returns the result and its wall time in seconds."""
    # not the make flags of a `make test` running this, nor a proxy that would not reach this loopback
    unset = {"MAKEFLAGS", "MFLAGS", "MAKELEVEL", "HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY"}
    clean_env = {k: v for k, v in os.environ.items() if k.upper() not in unset}
    started = time.monotonic()
    result = subprocess.run(
        ["make", "--no-print-directory", "-C", str(ROOT), "venv", f"VENV={tmp_path / 'venv'}", *args],
        env={**clean_env, **(env or {})},
        capture_output=True,
        text=True,
        timeout=120,
    )
    return result, time.monotonic() - started


def pip_calls(tmp_path: Path) -> list[str]:
    calls = tmp_path / "venv" / "bin" / "pip-calls"
    return calls.read_text().splitlines() if calls.exists() else []


@pytest.fixture
def venv(tmp_path: Path) -> Path:
    return write_script(tmp_path / "venv" / "bin" / "python", RECORDING_PYTHON)


@pytest.fixture
def closed_port() -> Iterator[int]:
    """A loopback port that refuses connections (bound, not listening) for the whole test."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        yield sock.getsockname()[1]


@pytest.fixture
def silent_port() -> Iterator[int]:
    """A loopback port that accepts connections and never answers: a stalled index."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen(8)
        yield sock.getsockname()[1]


@pytest.fixture
def index_server() -> Iterator[tuple[str, list[str]]]:
    """A loopback index that answers every GET; yields its URL and the paths asked for."""
    asked: list[str] = []

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            asked.append(self.path)
            body = b"<html><body></body></html>"
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_port}/whl/cpu", asked
    finally:
        server.shutdown()
        server.server_close()


def test_a_reachable_cpu_index_serves_torch(tmp_path: Path, venv: Path, index_server):
    url, asked = index_server
    result, _ = make_venv(tmp_path, f"TORCH_INDEX={url}")
    assert result.returncode == 0, result.stderr
    assert asked == ["/whl/cpu/torch/"], "the probe asks the index for torch's page"
    assert pip_calls(tmp_path) == [f"install --quiet --index-url {url} {TORCH}", "install --quiet -e .[dev]"]
    assert (tmp_path / "venv" / ".hetnode-installed").exists()


def test_the_default_index_when_the_cpu_index_fails_the_install(tmp_path: Path, venv: Path, index_server):
    url, _ = index_server
    result, _ = make_venv(tmp_path, f"TORCH_INDEX={url}", env={"FAKE_INDEX_INSTALL_RC": "1"})
    assert result.returncode == 0, result.stderr
    assert pip_calls(tmp_path)[1:] == [f"install --quiet {TORCH}", "install --quiet -e .[dev]"]
    assert "trying the default index" in result.stderr


@pytest.mark.parametrize("where", ["refused", "unresolvable"])
def test_an_unreachable_cpu_index_falls_back_at_once(tmp_path: Path, venv: Path, closed_port: int, where):
    url = {
        "refused": f"http://127.0.0.1:{closed_port}/whl/cpu",
        "unresolvable": "http://download.pytorch.invalid/whl/cpu",  # .invalid never resolves (RFC 2606)
    }[where]
    result, seconds = make_venv(tmp_path, f"TORCH_INDEX={url}")
    assert result.returncode == 0, result.stderr
    assert pip_calls(tmp_path) == [f"install --quiet {TORCH}", "install --quiet -e .[dev]"]
    assert f"{url} not reachable" in result.stdout
    assert seconds < 5, f"falling back took {seconds:.1f} s (the probe's timeout is 5 s; this needs none)"


def test_a_stalled_cpu_index_costs_only_the_probe_timeout(tmp_path: Path, venv: Path, silent_port: int):
    url = f"http://127.0.0.1:{silent_port}/whl/cpu"
    result, seconds = make_venv(tmp_path, f"TORCH_INDEX={url}", "TORCH_INDEX_PROBE_S=1")
    assert result.returncode == 0, result.stderr
    assert pip_calls(tmp_path) == [f"install --quiet {TORCH}", "install --quiet -e .[dev]"]
    assert 1 <= seconds < 5, f"falling back from a stalled index took {seconds:.1f} s"


def test_no_cpu_index_uses_the_default_one(tmp_path: Path, venv: Path):
    result, _ = make_venv(tmp_path, "TORCH_INDEX=")
    assert result.returncode == 0, result.stderr
    assert pip_calls(tmp_path) == [f"install --quiet {TORCH}", "install --quiet -e .[dev]"]
    assert "not reachable" not in result.stdout


def fake_interpreter(path: Path, version: str) -> Path:
    """An interpreter that says it is `version` and, asked for `-m venv DIR`, makes DIR with the recording
    python and notes who made it."""
    recording = write_script(path.parent / "recording-python", RECORDING_PYTHON)
    return write_script(
        path,
        f"""#!/bin/sh
case "$1" in
    -c) echo {version} ;;
    -m) mkdir -p "$3/bin" && cp {recording} "$3/bin/python" && echo "$0" > "$3/made-by" ;;
esac
""",
    )


def test_the_first_supported_python_makes_the_venv(tmp_path: Path):
    # a pyenv shim for a version pyenv does not run: on PATH, and fails
    shim = write_script(tmp_path / "bin" / "python3.11", "#!/bin/sh\necho 'pyenv: no 3.11' >&2\nexit 127\n")
    old = fake_interpreter(tmp_path / "bin" / "python3.10", "3.10")
    chosen = fake_interpreter(tmp_path / "bin" / "python3.13", "3.13")
    later = fake_interpreter(tmp_path / "bin" / "python3", "3.12")
    result, _ = make_venv(tmp_path, f"PYTHON={shim} {old} {chosen} {later}", "TORCH_INDEX=")
    assert result.returncode == 0, result.stderr
    assert (tmp_path / "venv" / "made-by").read_text().strip() == str(chosen)
    assert pip_calls(tmp_path) == [f"install --quiet {TORCH}", "install --quiet -e .[dev]"]


def test_no_supported_python_fails_before_installing_anything(tmp_path: Path):
    old = fake_interpreter(tmp_path / "bin" / "python3", "3.10")
    too_new = fake_interpreter(tmp_path / "bin" / "python3.14", "3.14")
    missing = tmp_path / "bin" / "python3.11"
    result, seconds = make_venv(tmp_path, f"PYTHON={missing} {old} {too_new}", "TORCH_INDEX=")
    assert result.returncode != 0
    assert not (tmp_path / "venv").exists(), "nothing is made or installed with an unsupported Python"
    assert f"{old}=3.10" in result.stderr and f"{too_new}=3.14" in result.stderr, "it names what it found"
    for way in ("uv python install", "pyenv install", "deadsnakes", "make PYTHON="):
        assert way in result.stderr, f"the message names how to get a supported Python ({way})"
    assert seconds < 5


def test_make_and_pyproject_admit_the_same_pythons():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    admitted = SpecifierSet(project["requires-python"])
    makefile = re.search(r"^SUPPORTED_PYTHONS := (.+)$", (ROOT / "Makefile").read_text(), re.MULTILINE)
    assert makefile, "the Makefile names its supported Pythons"
    minors = [f"3.{minor}" for minor in range(6, 20)]
    assert makefile.group(1).split() == [v for v in minors if f"{v}.0" in admitted]
