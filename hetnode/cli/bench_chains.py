"""`hetnode bench chains`: a chain with one worker per stage against a pool of two, a pool worker killed, a
spare stepping in and a lying pool worker, in the netns lab (root; issue 38)."""

from __future__ import annotations

import argparse
import dataclasses
import shlex
import sys
from pathlib import Path
from typing import Any

from hetnode.lab.runs.chains_plan import CASES  # light: no torch, hivemind or matplotlib

CONFIG_DIR = Path(__file__).resolve().parents[2] / "configs"


def register(benches: argparse._SubParsersAction) -> None:
    parser = benches.add_parser(
        "chains",
        help="a chain's pool against one worker, a killed worker, a spare stepping in, a lying worker (root)",
    )
    parser.add_argument(
        "--quick",
        action="store_true",
        help="30 s measured per throughput case, shorter waits (about 10 minutes)",
    )
    parser.add_argument("--config", type=Path, default=None, help="run config (default tiny)")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/chains"), help="output folder")
    parser.add_argument("--inner-steps", type=int, default=None, help="H (default: the plan's, 5)")
    parser.add_argument(
        "--cases",
        default=None,
        help=f"comma-separated cases to run, in this order (default {','.join(CASES)})",
    )
    parser.add_argument(
        "--measure",
        type=float,
        default=None,
        help="one_worker and two_workers: seconds measured from the first round sealed with the whole chain "
        "(default 240, --quick 30)",
    )
    parser.add_argument(
        "--fault-after",
        type=float,
        default=None,
        help="malicious_worker: seconds after its daemon starts that the liar turns "
        "(default 120, --quick 80)",
    )
    parser.add_argument(
        "--verify",
        action="store_true",
        help="run the coordinator's verifier (off by default: its scores, not the chain, would decide "
        "which rounds count)",
    )
    parser.add_argument(
        "--resummarise",
        action="store_true",
        help="no lab: write the report again from the runs an earlier benchmark left in --out (its work/)",
    )
    parser.add_argument("--no-progress", action="store_true")
    parser.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    from hetnode.config import load_config
    from hetnode.lab.runs import chains  # the lab and matplotlib, only when the benchmark runs
    from hetnode.lab.runs.chains_plan import plan_for

    if args.resummarise:
        report = chains.resummarise(args.out)
        print_summary(report)
        print(f"wrote {args.out / 'chains.json'} and {args.out / 'chains.png'}")
        return 0
    config = load_config(args.config or CONFIG_DIR / "tiny.toml")
    plan = plan_for(args.quick)
    if args.inner_steps is not None:
        plan = dataclasses.replace(plan, inner_steps=args.inner_steps)
    if args.cases is not None:
        plan = dataclasses.replace(plan, cases=tuple(c.strip() for c in args.cases.split(",") if c.strip()))
    if args.measure is not None:
        plan = dataclasses.replace(plan, measure_s=args.measure)
    if args.verify:
        plan = dataclasses.replace(plan, verify=True)
    if args.fault_after is not None:
        plan = dataclasses.replace(plan, fault_after_s=args.fault_after)
    command = "hetnode " + " ".join(shlex.quote(a) for a in sys.argv[1:])
    report = chains.run_benchmark(config, plan, args.out, not args.no_progress, command)
    print_summary(report)
    print(f"wrote {args.out / 'chains.json'} and {args.out / 'chains.png'}")
    return 0


def _show(value: Any, digits: int = 2) -> str:
    if value is None:
        return "n/a"
    return f"{value:,.{digits}f}" if isinstance(value, float) else str(value)


# case -> the figures its line shows
SHOWN = {
    "one_worker": ("tokens_per_s", "train_tokens_per_s", "seal_wait_s_p50", "anchor_compute_utilization"),
    "two_workers": ("tokens_per_s", "train_tokens_per_s", "seal_wait_s_p50", "anchor_compute_utilization"),
    "worker_killed": (
        "sealed_rounds_lost",
        "boundaries_to_recover",
        "pre_kill_tokens_per_s",
        "post_kill_tokens_per_s",
    ),
    "spare": ("rounds_lost", "successor_after_s", "lineage_kept"),
    "malicious_worker": (
        "rounds_to_drop",
        "rounds_to_blame",
        "eval_loss",
        "eval_loss_clean",
        "liar_rounds_sealed_after_drop",
    ),
}


def print_summary(report: dict[str, Any]) -> None:
    for case, keys in SHOWN.items():
        figures = report[case]
        if figures.get("error"):
            print(f"{case:<17} not measured: {figures['error'].splitlines()[0]}")
            continue
        print(f"{case:<17} " + "  ".join(f"{key} {_show(figures.get(key))}" for key in keys))
    print(
        f"two workers / one: tokens/s {_show(report['two_over_one_tokens_per_s'])}x, "
        f"while training {_show(report['two_over_one_train_tokens_per_s'])}x, "
        f"each against its anchor {_show(report['two_over_one_against_anchor'])}x"
    )
    print(f"digest disagreements: {report['digest_disagreements']} in {report['digest_checks']} checks")
    for name, t in report["targets"].items():
        verdict = {True: "met", False: "NOT met", None: "not measured"}[t["met"]]
        print(f"  {name:<50} {_show(t['value'], 3):>8} (limit {t['limit']:g}) {verdict}")
