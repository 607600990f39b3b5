"""How long the CLI takes to answer: `hetnode --help`, `hetnode <command> --help` for every command, and
`hetnode status` against a live coordinator on loopback, by its URL (`/api/swarm`) and by its multiaddr
(a DHT client of its own). Each is run as a fresh process, several times; the table shows the minimum
(what the code costs) and the median (what a user waits on this machine, as busy as it is).

    .venv/bin/python benchmarks/cli_speed.py     # writes benchmarks/results/cli-speed-issue33/cli.json
    .venv/bin/python benchmarks/cli_speed.py --runs 3 --hetnode /path/to/other/hetnode --out before.json

The coordinator is `hetnode bootstrap --config configs/tiny.toml` on 127.0.0.1 with a data dir of its own
(deleted after), stopped with SIGTERM once measured. Issue 33's targets: `--help` under 0.5 s, `status`
under 2 s.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

from machine_info import machine, when  # this folder's; scripts run as python benchmarks/NAME.py

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_OUT = ROOT / "benchmarks" / "results" / "cli-speed-issue33" / "cli.json"
READY_S = 120.0  # a coordinator importing torch and building the tiny model on a busy 2-core machine
TARGETS_S = {"help": 0.5, "status": 2.0}


def default_hetnode() -> list[str]:
    """The console script a user runs, from the environment of this interpreter."""
    script = Path(sys.executable).with_name("hetnode")
    return [str(script)] if script.exists() else [sys.executable, "-m", "hetnode.cli.main"]


def commands() -> list[str]:
    """Every subcommand of the current CLI (its parser is light: building it loads no torch)."""
    from hetnode.cli.main import build_parser

    parser = build_parser()
    [subparsers] = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    return sorted(subparsers.choices)


def time_once(argv: list[str], timeout: float = 120.0) -> tuple[float, int]:
    started = time.perf_counter()
    done = subprocess.run(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, timeout=timeout, cwd=ROOT)
    took = time.perf_counter() - started
    if done.returncode != 0:
        print(
            f"  {shlex.join(argv[-4:])}: exit {done.returncode}: {done.stderr.decode()[-300:]}",
            file=sys.stderr,
        )
    return took, done.returncode


def measure(argv: list[str], runs: int) -> dict:
    samples, codes = [], []
    for _ in range(runs):
        took, code = time_once(argv)
        samples.append(took)
        codes.append(code)
    return {
        "command": shlex.join(argv),
        "runs": runs,
        "min_s": round(min(samples), 3),
        "median_s": round(statistics.median(samples), 3),
        "samples_s": [round(s, 3) for s in samples],
        "exit_codes": sorted(set(codes)),
    }


class Coordinator:
    """`hetnode bootstrap` on loopback, until `stop()`; its READY line gives the URL and multiaddr."""

    def __init__(self, hetnode: list[str], data_dir: Path) -> None:
        argv = [*hetnode, "bootstrap", "--config", str(ROOT / "configs" / "tiny.toml")]
        argv += ["--listen", "/ip4/127.0.0.1/tcp/0", "--data-dir", str(data_dir), "--http-port", "0"]
        self.log = open(data_dir.parent / "coordinator.log", "w")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=self.log, text=True, cwd=ROOT)
        self.ready: dict[str, str] = {}
        self._seen = threading.Event()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            if line.startswith("READY ") and not self.ready:
                self.ready = dict(part.split("=", 1) for part in line.split()[1:])
                self._seen.set()

    def wait_ready(self) -> tuple[str, str]:
        if not self._seen.wait(READY_S):
            raise SystemExit(f"the coordinator printed no READY line in {READY_S:.0f} s; see its log")
        url, maddr = self.ready["http"], self.ready["maddrs"].split(",")[0]
        deadline = time.monotonic() + 30  # a coordinator that serves /api/swarm: until its first read
        while time.monotonic() < deadline:
            try:
                with urllib.request.urlopen(f"{url}/api/swarm", timeout=5):
                    break
            except urllib.error.HTTPError as exc:
                if exc.code == 404:  # an older coordinator: status reads the DHT
                    break
            except OSError:
                pass
            time.sleep(0.2)
        return url, maddr

    def stop(self) -> int | None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        self.log.close()
        return self.proc.returncode


def run(hetnode: list[str], runs: int, status_runs: int) -> dict:
    rows: dict[str, dict] = {}
    rows["--help"] = measure([*hetnode, "--help"], runs)
    for name in commands():
        rows[f"{name} --help"] = measure([*hetnode, name, "--help"], runs)
    with tempfile.TemporaryDirectory(prefix="hetnode-cli-speed-") as scratch:
        coordinator = Coordinator(hetnode, Path(scratch) / "coordinator")
        try:
            url, maddr = coordinator.wait_ready()
            rows["status --peer URL"] = measure([*hetnode, "status", "--peer", url], status_runs)
            port = url.rsplit(":", 1)[1].split("/")[0]
            signed = [*hetnode, "status", "--peer", maddr, "--coordinator-http-port", port]
            rows["status --peer MULTIADDR"] = measure(signed, status_runs)  # the document it signs
            dht = [*hetnode, "status", "--peer", maddr, "--coordinator-http-port", "off"]
            rows["status --peer MULTIADDR (DHT)"] = measure(dht, status_runs)
        finally:
            stopped = coordinator.stop()
    return {"rows": rows, "coordinator_exit": stopped}


def print_table(report: dict) -> None:
    print(f"{'command':<28} {'min s':>7} {'median s':>9} {'runs':>5}  target")
    for name, row in report["rows"].items():
        limit = TARGETS_S["status" if name.startswith("status --peer") else "help"]
        verdict = "met" if row["median_s"] < limit else "NOT met"
        failed = "" if row["exit_codes"] == [0] else f"  (exit {row['exit_codes']})"
        timing = f"{row['min_s']:>7.3f} {row['median_s']:>9.3f} {row['runs']:>5}"
        print(f"{name:<28} {timing}  < {limit:g} s {verdict}{failed}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=7, help="runs of each --help (default 7)")
    parser.add_argument("--status-runs", type=int, default=7, help="runs of each status form (default 7)")
    parser.add_argument("--hetnode", default=None, help="the command to time (default: this venv's hetnode)")
    parser.add_argument("--label", default="", help="what this run measures, kept in the JSON")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help=f"JSON file (default {DEFAULT_OUT})")
    args = parser.parse_args()
    hetnode = shlex.split(args.hetnode) if args.hetnode else default_hetnode()
    load_before = os.getloadavg()
    started = time.time()
    report = run(hetnode, args.runs, args.status_runs)
    report |= {
        "label": args.label,
        "hetnode": shlex.join(hetnode),
        "machine": machine(load_before),
        **when(started),
        "targets_s": TARGETS_S,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1) + "\n")
    print_table(report)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
