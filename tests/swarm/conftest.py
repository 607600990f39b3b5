"""Real daemons as subprocesses on loopback, started and stopped by the lab's launcher
(`hetnode/lab/swarm.py`): start them, wait for READY lines, query `hetnode status`, and on teardown stop the
peers, then the coordinators, and check that no p2pd is left behind."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path

import pytest

from hetnode.config import dump_config, load_config, replace
from hetnode.errors import HetnodeError
from hetnode.lab.demo.swarm import read_jsonl
from hetnode.lab.procs import LabProcess
from hetnode.lab.proctree import alive, descendants, process_name
from hetnode.lab.swarm import Launcher, Member
from hetnode.wire.round_history import merge_history

ROOT = Path(__file__).resolve().parents[2]
LOOPBACK = "/ip4/127.0.0.1/tcp/0"
HETNODE = [sys.executable, "-m", "hetnode.cli.main"]
ATTACKER = [sys.executable, str(ROOT / "tests" / "swarm" / "attacker.py")]  # the hostile peer
STOP_TIMEOUT_S = 30.0  # a daemon that has not exited by then is killed


class Daemon(LabProcess):
    """A test's daemon: in the test's process group (a test may signal it), its p2pd noted at READY."""

    def __init__(
        self, name: str, argv: list[str], log_path: Path, prefix: list[str] | None = None, *, detach=False
    ) -> None:
        super().__init__(name, argv, log_path, prefix, detach=detach)
        self.p2pd: list[int] = []

    def wait_ready(self, timeout: float = 90.0, stop=None) -> dict[str, str]:
        try:
            ready = super().wait_ready(timeout, stop)
        except HetnodeError as exc:  # a test failure, with the log's tail
            raise AssertionError(str(exc)) from None
        self.p2pd = [p for p in descendants(self.proc.pid) if process_name(p) == "p2pd"]
        return ready

    def live_p2pd(self) -> list[int]:
        return [pid for pid in self.p2pd if alive(pid)]

    @property
    def peer_id(self) -> str:
        assert self.ready is not None
        return self.ready["peer_id"]

    def tail(self, lines: int = 30) -> str:
        return super().tail(lines)

    def stop(self, sig: int | None = signal.SIGTERM, timeout: float = STOP_TIMEOUT_S) -> int | None:
        """Send `sig` (once; None when it was sent already), wait, and kill only if it hangs."""
        if self.proc.poll() is None and sig is not None:
            self.proc.send_signal(sig)
        return self.finish(timeout)


def all_evaluated(history: list[dict], upto: int | None = None) -> bool:
    """Every round (up to `upto`) has its evaluated line (a skipped evaluation has no eval loss)."""
    return all(e.get("evaluated", True) for e in history if upto is None or e["round"] <= upto)


class Swarm:
    def __init__(self, tmp_path: Path, data_dir: Path) -> None:
        self.tmp_path = tmp_path
        self.data_dir = data_dir  # the session's token cache: every daemon reads the corpus from here
        self.launcher = Launcher(tmp_path, detach=False, process=Daemon)
        self.daemons: list[Daemon] = []  # in order of start (a test may reorder it)

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

    def start_attack(
        self, name: str, seconds: float, *extra: str, stdout=subprocess.PIPE, stderr=subprocess.PIPE
    ) -> subprocess.Popen:
        """The hostile peer (`attacker.py`) runs attack `name` on the swarm for `seconds`, in the background
        (it joins through the first daemon started: the coordinator)."""
        return subprocess.Popen(
            [*ATTACKER, name, "--peer", self.daemons[0].maddr, "--seconds", str(seconds), *extra],
            stdout=stdout,
            stderr=stderr,
            text=True,
            cwd=ROOT,
        )

    @staticmethod
    def wait_attacking(attacker: subprocess.Popen) -> None:
        """Wait for the attacker to be set up and attacking (its `ATTACKING` line)."""
        for line in attacker.stdout:
            if line.startswith("ATTACKING"):
                return
        attacker.wait(10)
        raise AssertionError(f"the attacker ended before attacking:\n{attacker.stderr.read()[-3000:]}")

    @staticmethod
    def attack_result(attacker: subprocess.Popen, timeout: float) -> dict:
        """Wait for an attack to end by itself: what its `RESULT` line says the swarm let it do."""
        try:
            out, err = attacker.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            attacker.kill()
            attacker.communicate()
            raise
        lines = [line for line in out.splitlines() if line.startswith("RESULT ")]
        assert attacker.returncode == 0 and lines, f"the attacker failed:\n{err[-3000:]}"
        return json.loads(lines[-1].removeprefix("RESULT "))

    def start(
        self, name: str, args: list[str], prefix: list[str] | None = None, command: list[str] | None = None
    ) -> Daemon:
        """`command`: what runs instead of `hetnode` (a test's hook script that then runs the CLI)."""
        coordinator = args[:1] == ["bootstrap"]
        daemon = self.launcher.spawn(name, (command or HETNODE) + args, prefix or [], coordinator=coordinator)
        return self._started(daemon)

    def _started(self, daemon: LabProcess) -> Daemon:
        assert isinstance(daemon, Daemon)
        self.daemons.append(daemon)
        return daemon

    def bootstrap(
        self, config: Path, data_dir: Path | None = None, listen: str = LOOPBACK, extra=(), command=None
    ) -> Daemon:
        data_dir = data_dir or self.tmp_path / "bootstrap"
        if "--http-port" not in extra:
            extra = ["--http-port", "0", *extra]  # any free port: the READY line says which (http=...)
        boot = self.launcher.start_coordinator(
            config, data_dir, extra, name="bootstrap", listen=listen, command=command, prefix=[]
        )
        return self._started(boot)

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
        more = ["--data-cache", str(self.data_dir)]
        if "--metrics-port" not in extra:
            more += ["--metrics-port", "0"]  # every test daemon serves /metrics (READY says where)
        member = Member(name, None, bandwidth, (*more, *extra))
        daemon = self.launcher.start_peer(member, peer, listen=listen, command=command, prefix=prefix or [])
        return self._started(daemon)

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
        """The peers at once, then the coordinators (each group with one shared grace): exit codes."""
        self.launcher.stop(STOP_TIMEOUT_S)
        return {d.name: d.proc.returncode for d in self.daemons}

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
    leftovers += procs.launcher.kill_leftovers(only="p2pd")  # any noted below a daemon while it ran
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
