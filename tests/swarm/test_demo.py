"""`hetnode demo` end to end, as a user runs it: a swarm of real processes trains, the report and its plots
are written, the replicas agree with the coordinator, and neither a normal finish nor a Ctrl+C (to the
demo's whole process group, as a terminal sends it) leaves a daemon or a p2pd behind."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from bootstrap.ledger import Ledger
from hetnode.config import dump_config, load_config, replace
from hetnode.lab.demo.credit import credit_standings
from hetnode.lab.demo.markdown import result_line
from hetnode.lab.demo.swarm import read_jsonl
from hetnode.lab.proctree import alive, descendants, process_name, start_time
from hetnode.wire.round_history import merge_history

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
# One anchor and a chain of two keep the machine's two cores for three trainers; three rounds show the
# loss falling, the chain joining and the digest check.
SMALL_SWARM = ["--quick", "--anchors", "1", "--chains", "1"]


def demo_config(tmp_path: Path, data_dir: Path) -> Path:
    """tiny, with the session's token cache (nothing written to ~)."""
    config = replace(load_config(ROOT / "configs" / "tiny.toml"), "data", data_dir=str(data_dir))
    path = tmp_path / "tiny.toml"
    path.write_text(dump_config(config))
    return path


class Demo:
    """`hetnode demo` in a session of its own (so a signal can go to its whole process group), with every
    process below it noted while it runs."""

    def __init__(self, tmp_path: Path, args: list[str]) -> None:
        self.out = tmp_path / "out"
        self.stdout_path, self.stderr_path = tmp_path / "demo.out", tmp_path / "demo.err"
        with open(self.stdout_path, "w") as stdout, open(self.stderr_path, "w") as stderr:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "hetnode.cli.main", "demo", *args, "--out", str(self.out)],
                stdout=stdout,
                stderr=stderr,
                cwd=ROOT,
                env=dict(os.environ, PYTHONUNBUFFERED="1"),
                start_new_session=True,
            )
        self.seen: dict[int, tuple[str | None, str | None]] = {}  # pid -> (start time, name)

    def note(self) -> None:
        for pid in descendants(self.proc.pid):
            self.seen.setdefault(pid, (start_time(pid), process_name(pid)))

    def wait(self, timeout: float, until=None) -> int | None:
        """Note descendants every half second until the demo exits (or `until()` holds); its exit code."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            self.note()
            if self.proc.poll() is not None:
                return self.proc.returncode
            if until is not None and until():
                return None
            time.sleep(0.5)
        raise AssertionError(f"not within {timeout:.0f} s\n{self.output()}")

    def survivors(self) -> list[str]:
        return [
            f"{pid} ({name})"
            for pid, (started, name) in self.seen.items()
            if start_time(pid) == started and alive(pid)
        ]

    def output(self) -> str:
        logs = "".join(
            f"\n--- {log.name}\n" + "\n".join(log.read_text().splitlines()[-8:])
            for log in sorted((self.out / "swarm").glob("*.log"))
        )
        stderr = self.stderr_path.read_text()[-3000:]
        return f"--- stdout\n{self.stdout_path.read_text()}\n--- stderr\n{stderr}{logs}"

    def kill_all(self) -> None:
        """Teardown: never leave anything behind, even after a failed assertion."""
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)
        for pid, (started, _) in self.seen.items():
            if start_time(pid) == started and alive(pid):
                os.kill(pid, signal.SIGKILL)


@pytest.fixture
def run_demo(tmp_path: Path):
    demos: list[Demo] = []

    def start(args: list[str]) -> Demo:
        demos.append(Demo(tmp_path, args))
        return demos[-1]

    yield start
    for demo in demos:
        demo.kill_all()


def test_quick_demo_trains_checks_digests_and_writes_its_report(run_demo, tmp_path, data_dir):
    demo = run_demo([*SMALL_SWARM, "--rounds", "3", "--config", str(demo_config(tmp_path, data_dir))])
    started = time.monotonic()
    code = demo.wait(timeout=420)
    took = time.monotonic() - started
    assert code == 0, demo.output()
    assert not demo.survivors(), f"left behind: {demo.survivors()}"
    assert any(name == "p2pd" for _, name in demo.seen.values())  # the check above saw the daemons' p2pd

    for name in ("report.md", "summary.json", "loss.png", "bytes.png", "contributions.png", "config.toml"):
        assert (demo.out / name).stat().st_size > 0, name
    summary = json.loads((demo.out / "summary.json").read_text())
    assert summary["outcome"] == "finished" and summary["sealed_rounds"] == 3  # later seals: listed apart
    assert [r["round"] for r in summary["rounds"]] == [0, 1, 2]
    losses = [loss for loss in summary["eval_loss"] if loss is not None]
    assert len(losses) == 3 and losses[-1] < losses[0], summary["eval_loss"]  # the demo waits for round 2's
    assert summary["digests_agree"] is True, summary["digests"]
    assert {p["name"] for p in summary["digests"]["peers"]} == {"anchor-1", "edge-1", "edge-2"}
    assert summary["bytes"]["ratio"] > 50  # SparseLoCo against dense fp32
    assert {c["name"] for c in summary["contributions"]} >= {"anchor-1"}
    assert all(p["exit_code"] == 0 for p in summary["processes"]), summary["processes"]

    stdout = demo.stdout_path.read_text()
    assert "status page: http://127.0.0.1:" in stdout
    assert f"report: {demo.out / 'report.md'}" in stdout
    report = (demo.out / "report.md").read_text()
    assert "| round | contributors |" in report and "Every peer agrees" in report
    the_terminal_the_report_and_the_summary_agree(stdout, report, summary)
    the_reports_credit_is_the_ledgers(demo.out, summary)
    print(f"hetnode demo {' '.join(SMALL_SWARM)} --rounds 3: {took:.0f} s")


def the_terminal_the_report_and_the_summary_agree(stdout: str, report: str, summary: dict) -> None:
    """Rounds sealed, the final eval loss and the replica count: the same in all three (issue 33, item 7)."""
    lines = stdout.splitlines()
    # one plain line per round off a terminal, none past the rounds asked for
    sealed = [line.split("  ")[0] for line in lines if line.startswith("sealed ")]
    assert sealed == ["sealed 1/3 (round #0)", "sealed 2/3 (round #1)", "sealed 3/3 (round #2)"], stdout
    # the demo's last word is the report's headline, made from summary.json
    result = result_line(summary)
    assert result in lines and f"**{result}**" in report, (result, stdout)
    assert result.startswith("finished: 3 of 3 rounds sealed (#0–#2)")
    final = f"eval loss {summary['eval_loss'][0]:.3f} → {summary['loss_end']:.3f} after round #2"
    assert final in result and f"{summary['loss_end']:.3f} at the end" in report
    # replicas = anchors + chains, peers = processes beside the coordinator
    assert summary["swarm"] == {"peers": 3, "anchors": 1, "edges": 2, "chains": 1, "replicas": 2}
    assert "2 replicas (1 anchor + 1 chain), 3 peers" in result
    assert "digests: all 3 peers of the 2 replicas (1 anchor + 1 chain) equal" in stdout
    assert "All 3 peers of the 2 replicas (1 anchor + 1 chain) published" in report
    extra = summary["stopping_rounds"]  # sealed while the demo checked and stopped: said apart, if any
    assert all(r["round"] > 2 for r in extra)
    assert (f"{len(extra)} round(s), #" in stdout) == bool(extra) == ("Sealed while stopping" in report)


def the_reports_credit_is_the_ledgers(out: Path, summary: dict) -> None:
    """The report counts credit as the coordinator's ledger does (issue 33, item 6): over every sealed
    round, the history's credit rows less the refused ones are the ledger's standings; each stage shows its
    chain's tokens and is credited its part of them, and the parts add up to the chain's."""
    history = merge_history(read_jsonl(out / "swarm" / "bootstrap" / "rounds.jsonl"))
    with Ledger(out / "swarm" / "bootstrap" / "ledger.sqlite") as ledger:
        ledger_view = {s.peer: (s.tokens, s.replica_tokens, s.rounds) for s in ledger.standings()}
    assert {
        s["peer"]: (s["tokens"], s["replica_tokens"], s["rounds"]) for s in credit_standings(history)
    } == (ledger_view)
    schedule = 10 * 16 * 128  # H x batch x seq of --quick tiny
    for entry in history:
        credits = entry["credits"]
        assert all(row["replica_tokens"] == schedule for row in credits.values())
        stages = [row["tokens"] for row in credits.values() if row["role"] == "stage"]
        if len(stages) == 2:  # the whole chain in the seal: its tokens, split, by the weight each earned
            assert sum(stages) <= schedule and min(stages) > 0, credits
    rows = summary["contributions"]
    assert sum(r["share"] for r in rows) == pytest.approx(1.0)
    assert sum(r["tokens"] for r in rows) == sum(r["tokens"] for r in summary["rounds"])


def test_ctrl_c_stops_the_swarm_in_order_and_still_writes_the_report(run_demo, tmp_path, data_dir):
    demo = run_demo([*SMALL_SWARM, "--rounds", "50", "--config", str(demo_config(tmp_path, data_dir))])
    history = demo.out / "swarm" / "bootstrap" / "rounds.jsonl"
    code = demo.wait(timeout=300, until=lambda: history.exists() and history.read_text().strip())
    assert code is None, f"the demo ended early\n{demo.output()}"
    demo.note()
    os.killpg(demo.proc.pid, signal.SIGINT)  # what Ctrl+C at a terminal does: the whole foreground group
    interrupted = time.monotonic()
    code = demo.wait(timeout=90)
    took = time.monotonic() - interrupted
    assert code in (0, 130), demo.output()
    assert took < 60, f"{took:.0f} s to stop\n{demo.output()}"
    assert not demo.survivors(), f"left behind: {demo.survivors()}"

    summary = json.loads((demo.out / "summary.json").read_text())
    assert summary["outcome"] == "interrupted" and summary["sealed_rounds"] >= 1
    assert summary["digests"] is None
    assert (demo.out / "report.md").read_text().startswith("# hetnode demo")
    assert all((demo.out / name).exists() for name in ("loss.png", "bytes.png", "contributions.png"))
    assert all(p["exit_code"] == 0 for p in summary["processes"]), summary["processes"]  # none killed
    print(f"hetnode demo stopped {took:.0f} s after Ctrl+C, {summary['sealed_rounds']} rounds sealed")
