"""`hetnode bench utilization`: lockstep, overlapped, paced and paced+overlapped rounds, side by side in the
netns lab (root)."""

from __future__ import annotations

import argparse
import dataclasses
import shlex
import sys
from pathlib import Path
from typing import Any

from hetnode.errors import ConfigError

CONFIG_DIR = Path(__file__).resolve().parents[2] / "configs"


def register(benches: argparse._SubParsersAction) -> None:
    parser = benches.add_parser(
        "utilization",
        help="compute utilisation of lockstep, overlapped and paced rounds on slow links (root)",
    )
    parser.add_argument(
        "--quick", action="store_true", help="120 s per rule, 45 s without verification (about 15 minutes)"
    )
    parser.add_argument("--config", type=Path, default=None, help="run config (default tiny)")
    parser.add_argument(
        "--out", type=Path, default=Path("benchmarks/results/utilization"), help="output folder"
    )
    parser.add_argument("--inner-steps", type=int, default=None, help="H (default: the plan's, 5)")
    parser.add_argument(
        "--cap", type=int, default=None, help="paced: the cap of inner steps a round, in H (default 4)"
    )
    parser.add_argument(
        "--rules",
        default=None,
        help="comma-separated rules to run (default lockstep,overlap,paced,paced+overlap; lockstep and "
        "overlap always)",
    )
    parser.add_argument(
        "--caps",
        default=None,
        help="comma-separated caps in H: paced+overlap again at each, labelled paced+overlap@<c>H (e.g. 2,3)",
    )
    parser.add_argument(
        "--budget-quantile",
        type=float,
        default=None,
        help="paced: size rounds for the H steps of the replica at this quantile from the fastest "
        "(outer.budget_quantile; default the config's, 0.5)",
    )
    parser.add_argument(
        "--budget",
        type=float,
        default=None,
        help="wall seconds per rule once every replica runs (default 600, --quick 120)",
    )
    parser.add_argument(
        "--resummarise",
        action="store_true",
        help="no lab: write the report again from the runs an earlier benchmark left in --out (its work/)",
    )
    parser.add_argument("--no-progress", action="store_true")
    parser.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    from hetnode.config import load_config, replace
    from hetnode.lab.runs import utilization  # the lab and matplotlib, only when the benchmark runs
    from hetnode.lab.runs.utilization_plan import plan_for

    config = load_config(args.config or CONFIG_DIR / "tiny.toml")
    if args.budget_quantile is not None:  # checked as the config's own value would be
        config = replace(config, "outer", budget_quantile=args.budget_quantile)
    if args.resummarise:
        report = utilization.resummarise(config, args.out)
        print_summary(report)
        print(f"wrote {args.out / 'utilization.json'} and {args.out / 'utilization.png'}")
        return 0
    plan = plan_for(args.quick)
    if args.inner_steps is not None:
        plan = dataclasses.replace(plan, inner_steps=args.inner_steps)
    if args.cap is not None:
        plan = dataclasses.replace(plan, cap_ratio=args.cap)
    if args.rules is not None:
        plan = dataclasses.replace(plan, rules=tuple(r.strip() for r in args.rules.split(",") if r.strip()))
    if args.caps is not None:
        plan = dataclasses.replace(plan, extra_caps=_caps(args.caps))
    if args.budget is not None:
        plan = dataclasses.replace(
            plan, budget_s=args.budget, no_verify_budget_s=max(20.0, args.budget / 2.5)
        )
    command = "hetnode " + " ".join(shlex.quote(a) for a in sys.argv[1:])
    report = utilization.run_benchmark(config, plan, args.out, not args.no_progress, command)
    print_summary(report)
    print(f"wrote {args.out / 'utilization.json'} and {args.out / 'utilization.png'}")
    return 0


def _caps(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(c) for c in text.split(",") if c.strip())
    except ValueError:
        raise ConfigError(
            "--caps", "bench utilization", f"whole numbers of H, e.g. 2,3; got {text!r}"
        ) from None


def _show(value: Any, digits: int = 2) -> str:
    return "n/a" if value is None else f"{value:,.{digits}f}"


def print_summary(report: dict[str, Any]) -> None:
    rules = report["rules"]
    print(
        f"{'replica':<10} {'role':<7} " + " ".join(f"{label + ' util':>14} {'tok/s':>8}" for label in rules)
    )
    names = max(([(r["name"], r["role"]) for r in rule["replicas"]] for rule in rules.values()), key=len)
    for name, role in names:
        cells = []
        for rule in rules.values():
            r = next((r for r in rule["replicas"] if r["name"] == name), {})
            cells.append(f"{_show(r.get('compute_utilization')):>14} {_show(r.get('tokens_per_s'), 0):>8}")
        steps = {
            label: r["inner_steps"]
            for label, rule in rules.items()
            for r in rule["replicas"]
            if r["name"] == name and r.get("inner_steps")
        }
        print(f"{name:<10} {role:<7} " + " ".join(cells))
        if any(label.startswith("paced") for label in steps):
            per_rule = "  ".join(
                f"{label} {min(v)}-{max(v)}" for label, v in steps.items() if label.startswith("paced")
            )
            print(f"{'':<18} inner steps a round: {per_rule}")
    for label, rule in rules.items():
        if rule.get("error"):
            print(f"{label}: not measured: {rule['error'].splitlines()[0]}")
    for key in (
        "swarm_tokens_per_s",
        "eval_loss_at_equal_tokens",
        "eval_loss_at_equal_wall",
        "seal_to_seal_s",
    ):
        print(f"{key:<28} " + "  ".join(f"{label} {_show(rule[key], 3)}" for label, rule in rules.items()))
    quiet = report.get("no_verify") or {}
    print(
        f"seal to seal without verification ({quiet.get('rule')}): {_show(quiet.get('seal_to_seal_s'), 3)} s"
    )
    h = report["H_check"]
    share = _show(h["lockstep_anchor_sync_share"])
    print(
        f"H = {report['config']['H']}: a lockstep anchor round spends {share} of its wall time in sync "
        f"(planned 0.30-0.60: {'yes' if h['met'] else 'no'})"
    )
    for label, c in (report.get("cap_sweep") or {}).items():
        print(
            f"cap {c['cap']}H ({label}): tokens/s {_show(c['swarm_tokens_per_s_over_overlap'])}x overlap, "
            f"eval loss {_show(c['eval_loss_at_equal_tokens_over_lockstep'], 3)}x lockstep at equal tokens, "
            f"{_show(c['eval_loss_at_equal_wall_over_lockstep'], 3)}x at equal wall, "
            f"anchors' utilisation >= {_show(c['min_anchor_utilization'])}"
        )
    for name, t in report["targets"].items():
        verdict = {True: "met", False: "NOT met", None: "not measured"}[t["met"]]
        print(f"  {name:<50} {_show(t['value'], 3):>8} (limit {t['limit']:g}) {verdict}")
    if report.get("note"):
        print(f"note: {report['note']}")
