"""`hetnode bench soak`: the long churn run in the netns lab (root)."""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path

from hetnode.errors import HetnodeError
from hetnode.lab.netlab.wan import PRESETS
from hetnode.lab.runs.soak_plan import SoakPlan

CONFIG_DIR = Path(__file__).resolve().parents[2] / "configs"


def register(benches: argparse._SubParsersAction) -> None:
    parser = benches.add_parser(
        "soak", help="real daemons for N minutes while peers join, leave, crash and lose links (root)"
    )
    parser.add_argument("--minutes", type=float, default=60.0, help="length of the run (default 60)")
    parser.add_argument("--config", type=Path, default=None, help="run config (default tiny)")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/soak"), help="output folder")
    parser.add_argument(
        "--wan",
        action="append",
        default=None,
        metavar="HOST=PRESET",
        help="a lab host's link preset (hetnode.lab.netlab.wan.PRESETS), repeatable; default "
        + ",".join(f"{h}={p}" for h, p in SoakPlan().wan),
    )
    parser.add_argument(
        "--rejudge",
        action="store_true",
        help="recompute a finished run's catch-up and resource verdicts in --out from its logs and samples",
    )
    parser.add_argument("--no-progress", action="store_true")
    parser.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    from hetnode.config import load_config
    from hetnode.lab.runs import soak  # the lab and matplotlib, only when a soak runs
    from hetnode.lab.runs.soak_report import rejudge, write_report

    if args.rejudge:
        report = rejudge(args.out)
        json_path, png_path = write_report(report, args.out)
        print(f"re-judged {json_path} and {png_path}")
        _summary(report)
        return 0
    config = load_config(args.config or CONFIG_DIR / "tiny.toml")
    plan = SoakPlan(minutes=args.minutes)
    if args.wan is not None:
        plan = dataclasses.replace(plan, wan=tuple(_host_preset(item) for item in args.wan))
    report = soak.run_soak(config, plan, args.out, progress=not args.no_progress)
    json_path, png_path = write_report(report, args.out)
    _summary(report)
    print(f"wrote {json_path} and {png_path}")
    return 0


def _summary(report: dict) -> None:
    print(f"rounds sealed: {report['rounds_sealed']}; churn events: {len(report['churn_events'])}")
    print(
        f"digest disagreements: {report['digest_disagreements']} "
        f"(half-applied {report['half_applied_rounds']}) in {report['digest_checks']} checks; "
        f"ledger mismatches: {report['ledger_mismatches']}"
    )
    print(
        f"chain re-formed in {report['chain_reform_boundaries']} boundaries; rounds to the swarm's θ after a "
        f"return: {report['catch_up_rounds']}; to a sealed round: {report.get('contributing_after_rounds')}"
    )
    print(f"worst growth per hour: RSS {report['rss_growth_per_hour']}, fds {report['fd_growth_per_hour']}")
    print(f"left behind: {report['left_behind']}")


def _host_preset(item: str) -> tuple[str, str]:
    host, _, preset = item.partition("=")
    if not host or preset not in PRESETS:
        raise HetnodeError(f"--wan {item!r}: use HOST=PRESET with a preset of {', '.join(PRESETS)}")
    return host, preset
