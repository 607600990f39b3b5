"""`hetnode bench soak`: the long churn run in the netns lab (root)."""

from __future__ import annotations

import argparse
from pathlib import Path

from hetnode.bench import soak
from hetnode.config import load_config

CONFIG_DIR = Path(__file__).resolve().parents[2] / "configs"


def register(benches: argparse._SubParsersAction) -> None:
    parser = benches.add_parser(
        "soak", help="real daemons for N minutes while peers join, leave, crash and lose links (root)"
    )
    parser.add_argument("--minutes", type=float, default=60.0, help="length of the run (default 60)")
    parser.add_argument("--config", type=Path, default=None, help="run config (default tiny)")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/soak"), help="output folder")
    parser.add_argument("--no-progress", action="store_true")
    parser.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    config = load_config(args.config or CONFIG_DIR / "tiny.toml")
    plan = soak.SoakPlan(minutes=args.minutes)
    report = soak.run_soak(config, plan, args.out, progress=not args.no_progress)
    json_path, png_path = soak.write_report(report, args.out)
    print(f"rounds sealed: {report['rounds_sealed']}; churn events: {len(report['churn_events'])}")
    print(
        f"digest disagreements: {report['digest_disagreements']} "
        f"(half-applied {report['half_applied_rounds']}) in {report['digest_checks']} checks; "
        f"ledger mismatches: {report['ledger_mismatches']}"
    )
    print(
        f"chain re-formed in {report['chain_reform_boundaries']} boundaries; catch-up (rounds): "
        f"{report['catch_up_rounds']}"
    )
    print(f"worst growth per hour: RSS {report['rss_growth_per_hour']}, fds {report['fd_growth_per_hour']}")
    print(f"left behind: {report['left_behind']}")
    print(f"wrote {json_path} and {png_path}")
    return 0
