"""Real daemons as subprocesses on loopback: start them, wait for READY lines, query `hetnode status`,
and on teardown stop every one of them and check that no p2pd is left behind."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path

import pytest

from hetnode.config import dump_config, load_config, replace
from hetnode.lab.demo.swarm import alive, descendants, process_name, read_jsonl
from hetnode.wire.round_history import merge_history

ROOT = Path(__file__).resolve().parents[2]
LOOPBACK = "/ip4/127.0.0.1/tcp/0"
HETNODE = [sys.executable, "-m", "hetnode.cli.main"]


class Daemon:
    def __init__(
        self, name: str, args: list[str], log_path: Path, prefix: list[str], command: list[str] | None = None
    ) -> None:
        self.name = name
        self.log_path = log_path
        self.log = open(log_path, "w")  # noqa: SIM115 - closed in stop()
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        self.proc = subprocess.Popen(
            prefix + (command or HETNODE) + args,
            stdout=subprocess.PIPE,
            stderr=self.log,
            text=True,
            cwd=ROOT,
            env=env,
        )
        self.lines: list[str] = []
        self.ready: dict[str, str] | None = None
        self._ready_event = threading.Event()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()
        self.p2pd: list[int] = []

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.lines.append(line.rstrip("\n"))
            if line.startswith("READY ") and self.ready is None:
                self.ready = dict(part.split("=", 1) for part in line.split()[1:])
                self._ready_event.set()

    def wait_ready(self, timeout: float = 90.0) -> dict[str, str]:
        if not self._ready_event.wait(timeout):
            raise AssertionError(f"{self.name} printed no READY line in {timeout:.0f} s:\n{self.tail()}")
        self.p2pd = [p for p in descendants(self.proc.pid) if process_name(p) == "p2pd"]
        return self.ready

    def live_p2pd(self) -> list[int]:
        return [pid for pid in self.p2pd if alive(pid)]

    @property
    def peer_id(self) -> str:
        assert self.ready is not None
        return self.ready["peer_id"]

    @property
    def maddr(self) -> str:
        assert self.ready is not None
        return self.ready["maddrs"].split(",")[0]

    def tail(self, lines: int = 30) -> str:
        if not self.log.closed:
            self.log.flush()
        text = self.log_path.read_text().splitlines()[-lines:]
        return "\n".join(text)

    def stop(self, sig: int | None = signal.SIGTERM, timeout: float = 30.0) -> int | None:
        """Send `sig` (once; None when it was sent already), wait, and kill only if it hangs."""
        if self.proc.poll() is None:
            if sig is not None:
                self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        self.log.close()
        return self.proc.returncode


def all_evaluated(history: list[dict], upto: int | None = None) -> bool:
    """Every round (up to `upto`) has its evaluated line (a skipped evaluation has no eval loss)."""
    return all(e.get("evaluated", True) for e in history if upto is None or e["round"] <= upto)


class Swarm:
    def __init__(self, tmp_path: Path, data_dir: Path) -> None:
        self.tmp_path = tmp_path
        self.data_dir = data_dir  # the session's token cache: every daemon reads the corpus from here
        self.daemons: list[Daemon] = []

    all_evaluated = staticmethod(all_evaluated)

    def config(
        self, pipeline: dict | None = None, network: dict | None = None, outer: dict | None = None
    ) -> Path:
        config = replace(load_config(ROOT / "configs" / "tiny.toml"), "data", data_dir=str(self.data_dir))
        for section, changes in (("pipeline", pipeline), ("network", network), ("outer", outer)):
            if changes:
                config = replace(config, section, **changes)
        path = self.tmp_path / "swarm.toml"
        path.write_text(dump_config(config))
        return path

    def start(
        self, name: str, args: list[str], prefix: list[str] | None = None, command: list[str] | None = None
    ) -> Daemon:
        """`command`: what runs instead of `hetnode` (a test's hook script that then runs the CLI)."""
        daemon = Daemon(name, args, self.tmp_path / f"{name}.log", prefix or [], command)
        self.daemons.append(daemon)
        return daemon

    def bootstrap(
        self, config: Path, data_dir: Path | None = None, listen: str = LOOPBACK, extra=(), command=None
    ) -> Daemon:
        data_dir = data_dir or self.tmp_path / "bootstrap"
        args = ["bootstrap", "--config", str(config), "--listen", listen, "--data-dir", str(data_dir)]
        if "--http-port" not in extra:
            args += ["--http-port", "0"]  # any free port: the READY line says which (http=...)
        return self.start("bootstrap", [*args, *extra], command=command)

    def join(
        self,
        name: str,
        peer: str,
        bandwidth: str = "auto",
        listen: str = LOOPBACK,
        extra=(),
        prefix=None,
        command=None,
    ):
        """`command`: what runs instead of `hetnode` (a test's hook script that then runs the CLI)."""
        args = ["join", "--peer", peer, "--name", name, "--bandwidth", bandwidth, "--listen", listen]
        args += ["--data-dir", str(self.tmp_path / name), "--data-cache", str(self.data_dir)]
        if "--metrics-port" not in extra:
            args += ["--metrics-port", "0"]  # every test daemon serves /metrics (READY says where)
        return self.start(name, [*args, *extra], prefix, command)

    def status(self, peer: str, prefix: list[str] | None = None) -> dict:
        result = subprocess.run(
            (prefix or []) + HETNODE + ["status", "--peer", peer, "--json", "--timeout", "20"],
            capture_output=True,
            text=True,
            timeout=60,
            cwd=ROOT,
        )
        assert result.returncode == 0, result.stderr[-2000:]
        return json.loads(result.stdout)

    def contributions(self, coordinator: Daemon) -> dict:
        """The coordinator's ledger as its status API serves it."""
        with urllib.request.urlopen(f"{coordinator.ready['http']}/api/contributions", timeout=10) as response:
            return json.loads(response.read())

    def metric(self, daemon: Daemon, name: str) -> float:
        """One unlabelled sample from a daemon's /metrics (0 when the series is not there)."""
        url = daemon.ready.get("metrics") or f"{daemon.ready['http']}/metrics"  # the coordinator: its http
        with urllib.request.urlopen(url, timeout=10) as response:
            text = response.read().decode()
        for line in text.splitlines():
            if line.startswith(name + " "):
                return float(line.split()[1])
        return 0.0

    def wait_for(self, peer: str, check: Callable[[dict], bool], timeout: float, what: str) -> dict:
        deadline = time.monotonic() + timeout
        document: dict = {}
        while time.monotonic() < deadline:
            document = self.status(peer)
            if check(document):
                return document
            time.sleep(1.0)
        logs = "\n".join(f"--- {d.name}\n{d.tail(8)}" for d in self.daemons)
        raise AssertionError(
            f"not within {timeout:.0f} s: {what}\nlast status: {json.dumps(document)}\n{logs}"
        )

    def stop_all(self) -> dict[str, int | None]:
        for daemon in self.daemons:  # signal all first: they shut down in parallel
            if daemon.proc.poll() is None:
                daemon.proc.send_signal(signal.SIGTERM)
        return {d.name: d.stop(sig=None) for d in self.daemons}

    def history(self, data_dir: Path | None = None) -> list[dict]:
        """The coordinator's sealed rounds: one entry per seal line, its evaluated line (scores, credit,
        eval loss, sample: written later, beside the next seals) merged in."""
        return merge_history(read_jsonl((data_dir or self.tmp_path / "bootstrap") / "rounds.jsonl"))

    def agree_with_coordinator(self, document: dict, names: set[str]) -> dict[str, int]:
        """Every named replica's (params_round, layer_digests) equals the coordinator's record of that
        round (a chain stage's: for the layers it holds); returns each one's params_round.

        A replica applies a round as soon as it has the seal; the coordinator writes the round to its
        history right after committing it and before publishing its digests: wait for its history."""
        wanted = {
            p["params_round"]
            for p in document["peers"]
            if p["name"] in names and p["params_round"] is not None
        }
        deadline = time.monotonic() + 30
        while True:
            by_round = {entry["round"]: entry["layer_digests"] for entry in self.history()}
            if wanted <= set(by_round) or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        rounds = {}
        for peer in document["peers"]:
            if peer["name"] in names and peer["params_round"] is not None:
                held, theirs = peer["layer_digests"], by_round[peer["params_round"]]
                assert held and held == {shard: theirs[shard] for shard in held}, peer["name"]
                if peer["role"] == "anchor":
                    assert set(held) == set(theirs), peer["name"]  # an anchor holds every layer
                rounds[peer["name"]] = peer["params_round"]
        return rounds

    def replicas_agree_at(self, peer: str, round_: int, names: set[str]) -> dict[str, int]:
        """Wait until every anchor and stage holds `round_` or later; then every named replica must hold
        exactly the coordinator's θ of the round it reports."""
        document = self.wait_for(
            peer,
            lambda d: all(
                (p["params_round"] or -1) >= round_ for p in d["peers"] if p["role"] in ("anchor", "stage")
            ),
            timeout=60,
            what=f"every replica applied round {round_}",
        )
        rounds = self.agree_with_coordinator(document, names)
        assert set(rounds) == names, rounds
        return rounds

    def freeze_past_seals(self, daemon: Daemon, seals: int = 2, timeout: float = 120) -> int:
        """Freeze `daemon` (SIGSTOP: a laptop asleep) while `seals` rounds are sealed without it, wake it, and
        wait until it says what became of the payload it had announced. Returns the round it froze at."""
        daemon.proc.send_signal(signal.SIGSTOP)
        frozen_at = self.history()[-1]["round"]
        self.wait_for_round(frozen_at + seals, timeout=timeout)
        daemon.proc.send_signal(signal.SIGCONT)
        settled = ("sealed without us: our payload is kept in error feedback", "sealed with our payload")
        deadline = time.monotonic() + timeout
        while not any(line in daemon.tail(300) for line in settled) and time.monotonic() < deadline:
            time.sleep(1)
        assert any(line in daemon.tail(300) for line in settled), daemon.tail(40)
        return frozen_at

    def wait_for_round(self, round_: int, timeout: float, evaluated: bool = False) -> list[dict]:
        """The history once `round_` is sealed (with `evaluated`: once every round up to it is evaluated
        too, which the coordinator does beside the next seals)."""
        return self.wait_for_history(
            lambda history: (
                bool(history)
                and history[-1]["round"] >= round_
                and (not evaluated or all_evaluated(history, round_))
            ),
            timeout,
            f"round {round_} sealed{' and evaluated' if evaluated else ''}",
        )

    def wait_for_history(self, check: Callable[[list[dict]], bool], timeout: float, what: str) -> list[dict]:
        """The coordinator's history once `check` accepts it."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            history = self.history()
            if check(history):
                return history
            time.sleep(0.5)
        logs = "\n".join(f"--- {d.name}\n{d.tail(8)}" for d in self.daemons)
        raise AssertionError(f"not within {timeout:.0f} s: {what}\n{logs}")

    def leftover_p2pd(self) -> list[int]:
        return [pid for d in self.daemons for pid in d.p2pd if alive(pid)]


def _stop_and_check(procs: Swarm) -> None:
    procs.stop_all()
    leftovers = procs.leftover_p2pd()
    for pid in leftovers:  # never leave one behind, but fail the test that did
        os.kill(pid, signal.SIGKILL)
    assert not leftovers, f"p2pd processes survived their daemons: {leftovers}"


@pytest.fixture
def swarm(tmp_path: Path, data_dir: Path):
    procs = Swarm(tmp_path, data_dir)
    try:
        yield procs
    finally:
        _stop_and_check(procs)


@pytest.fixture(scope="module")
def module_swarm(tmp_path_factory: pytest.TempPathFactory, data_dir: Path):
    """One swarm shared by a module's tests: each adds what it needs and checks from where it began."""
    procs = Swarm(tmp_path_factory.mktemp("swarm"), data_dir)
    try:
        yield procs
    finally:
        _stop_and_check(procs)
