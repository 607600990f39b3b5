"""How long `hetnode sample --tokens 50` takes against stock `transformers` doing the same from the exported
folder of the same checkpoint, each a fresh process with its imports (what a user waits for). The runs of
the two alternate, after one warm-up of each, so both meet the machine as busy as it is; the table shows
the minimum (what the code costs) and the median. Issue 33's target: `sample` within 2x of transformers.

    .venv/bin/python benchmarks/sample_speed.py   # writes benchmarks/results/cli-speed-issue33/sample.json
    .venv/bin/python benchmarks/sample_speed.py --run runs/try --runs 5
    .venv/bin/python benchmarks/sample_speed.py --hetnode OLD_HETNODE --pass-folder --out before.json

Without `--run` it trains the tiny config for a few steps into a scratch folder (a `hetnode train` run
folder, which `sample` and `export` take as `--from`), and exports it there; transformers is in the dev
extras (`pip install -e '.[dev]'`). `--hetnode` times another `hetnode` on the same checkpoint
(`--pass-folder`: given the checkpoint folder itself, for a version that does not take a run folder).
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from machine_info import machine, when  # this folder's; scripts run as python benchmarks/NAME.py

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_OUT = ROOT / "benchmarks" / "results" / "cli-speed-issue33" / "sample.json"
PROMPT = "The history of"
TOKENS = 50
TARGET_RATIO = 2.0
# the stock path, imports included: what docs/export.md shows a user, sampling as `hetnode sample` does
STOCK = """
import sys
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer
folder, prompt, tokens = sys.argv[1], sys.argv[2], int(sys.argv[3])
tokenizer = AutoTokenizer.from_pretrained(folder)
model = AutoModelForCausalLM.from_pretrained(folder)
torch.manual_seed(0)
inputs = tokenizer(prompt, return_tensors="pt")
out = model.generate(**inputs, max_new_tokens=tokens, min_new_tokens=tokens, do_sample=True, temperature=0.8)
sys.stdout.write(tokenizer.decode(out[0]) + "\\n")
"""


def hetnode_command() -> list[str]:
    script = Path(sys.executable).with_name("hetnode")
    return [str(script)] if script.exists() else [sys.executable, "-m", "hetnode.cli.main"]


def check_run(argv: list[str]) -> None:
    done = subprocess.run(argv, capture_output=True, text=True, cwd=ROOT)
    if done.returncode != 0:
        raise SystemExit(f"{shlex.join(argv)} exited {done.returncode}:\n{done.stderr[-2000:]}")


def time_once(argv: list[str]) -> tuple[float, int, int]:
    """(seconds, exit code, bytes printed) of one fresh process."""
    started = time.perf_counter()
    done = subprocess.run(argv, capture_output=True, timeout=600, cwd=ROOT)
    took = time.perf_counter() - started
    if done.returncode != 0:
        print(f"  {shlex.join(argv[:3])}…: exit {done.returncode}: {done.stderr[-300:]!r}", file=sys.stderr)
    return took, done.returncode, len(done.stdout)


def summary(argv: list[str], samples: list[tuple[float, int, int]]) -> dict:
    seconds = [s for s, _, _ in samples]
    return {
        "command": shlex.join(argv),
        "runs": len(samples),
        "min_s": round(min(seconds), 3),
        "median_s": round(statistics.median(seconds), 3),
        "samples_s": [round(s, 3) for s in seconds],
        "exit_codes": sorted({code for _, code, _ in samples}),
        "bytes_printed": sorted({size for _, _, size in samples}),
    }


def prepare(scratch: Path, run: Path | None, steps: int) -> tuple[Path, Path]:
    """The run folder to sample from and its export (made here when not given)."""
    hetnode = hetnode_command()
    if run is None:
        run = scratch / "run"
        config = ROOT / "configs" / "tiny.toml"
        check_run([*hetnode, "train", "--config", str(config), "--max-steps", str(steps), "--out", str(run)])
    hf = scratch / "hf"
    check_run([*hetnode, "export", "--from", str(run), "--out", str(hf)])
    return run, hf


def measure(hetnode: list[str], source: Path, hf: Path, runs: int) -> dict:
    ours = [*hetnode, "sample", "--from", str(source), "--prompt", PROMPT, "--tokens", str(TOKENS)]
    stock = [sys.executable, "-c", STOCK, str(hf), PROMPT, str(TOKENS)]
    for argv in (ours, stock):  # warm-up: the page cache, Python's bytecode cache
        time_once(argv)
    samples: dict[str, list] = {"hetnode sample": [], "transformers": []}
    for _ in range(runs):
        samples["hetnode sample"].append(time_once(ours))
        samples["transformers"].append(time_once(stock))
    rows = {"hetnode sample": summary(ours, samples["hetnode sample"])}
    rows["transformers"] = summary(stock[:2] + ["STOCK", *stock[3:]], samples["transformers"])
    a, b = rows["hetnode sample"], rows["transformers"]
    return {
        "rows": rows,
        "ratio_min": round(a["min_s"] / b["min_s"], 3),
        "ratio_median": round(a["median_s"] / b["median_s"], 3),
        "stock_script": STOCK.strip(),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--run", type=Path, default=None, help="a `hetnode train` run folder (default: train one)"
    )
    parser.add_argument("--steps", type=int, default=20, help="steps of the run trained here (default 20)")
    parser.add_argument("--runs", type=int, default=7, help="timed runs of each (default 7)")
    parser.add_argument("--hetnode", default=None, help="the hetnode command to time (default: this venv's)")
    parser.add_argument(
        "--pass-folder", action="store_true", help="--from the checkpoint folder, not the run"
    )
    parser.add_argument("--label", default="", help="what this run measures, kept in the JSON")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help=f"JSON file (default {DEFAULT_OUT})")
    args = parser.parse_args()
    load_before = os.getloadavg()
    started = time.time()
    with tempfile.TemporaryDirectory(prefix="hetnode-sample-speed-") as scratch:
        run, hf = prepare(Path(scratch), args.run, args.steps)
        source = max((run / "checkpoints").glob("round-*")) if args.pass_folder else run
        hetnode = shlex.split(args.hetnode) if args.hetnode else hetnode_command()
        report = measure(hetnode, source, hf, args.runs)
    report |= {
        "label": args.label,
        "tokens": TOKENS,
        "prompt": PROMPT,
        "machine": machine(load_before),
        **when(started),
        "target_ratio": TARGET_RATIO,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1) + "\n")
    print(f"{'':<16} {'min s':>7} {'median s':>9} {'runs':>5}")
    for name, row in report["rows"].items():
        print(f"{name:<16} {row['min_s']:>7.3f} {row['median_s']:>9.3f} {row['runs']:>5}")
    verdict = "met" if report["ratio_median"] <= TARGET_RATIO else "NOT met"
    print(
        f"ratio hetnode/transformers: {report['ratio_min']:.2f}x (min), "
        f"{report['ratio_median']:.2f}x (median); target <= {TARGET_RATIO:g}x {verdict}"
    )
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
