"""`hetnode demo`: the README's first command; a whole swarm on this machine, watched live, then a report."""

from __future__ import annotations

import argparse
from pathlib import Path

CONFIG_DIR = Path(__file__).resolve().parents[2] / "configs"
QUICK_ROUNDS, FULL_ROUNDS = 8, 30


def register(commands: argparse._SubParsersAction) -> None:
    demo = commands.add_parser(
        "demo", help="run a coordinator, anchors and a chain of edge peers here; watch them; write a report"
    )
    demo.add_argument(
        "--quick",
        action="store_true",
        help=f"tiny config with H=10 and {QUICK_ROUNDS} rounds (a few minutes on 2 cores)",
    )
    demo.add_argument(
        "--config", type=Path, default=None, help="run config (default: tiny if --quick, else small)"
    )
    demo.add_argument("--anchors", type=int, default=2, help="full replicas on fast links (default 2)")
    demo.add_argument(
        "--chain-stages", type=int, default=None, help="edge peers per chain (default: the config's stages)"
    )
    demo.add_argument("--chains", type=int, default=1, help="chains of edge peers (default 1)")
    demo.add_argument(
        "--chain-workers",
        type=int,
        default=1,
        help="workers on each chain's slowest stage: a pool sharing its micro-batches (default 1)",
    )
    demo.add_argument("--edge-mbit", type=float, default=20.0, help="the edges' link speed in Mbit/s")
    demo.add_argument(
        "--rounds",
        type=int,
        default=None,
        help=f"sealed rounds to run (default {QUICK_ROUNDS} with --quick, else {FULL_ROUNDS})",
    )
    demo.add_argument("--out", type=Path, default=Path("runs/demo"), help="report folder (default runs/demo)")
    demo.add_argument(
        "--shaped",
        action="store_true",
        help="each process in its own network namespace, edges shaped with tc (needs root)",
    )
    demo.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    from hetnode.lab.demo.run import DemoOptions, run_demo  # rich and matplotlib only when used

    options = DemoOptions(
        config_path=args.config or CONFIG_DIR / ("tiny.toml" if args.quick else "small.toml"),
        out=args.out,
        rounds=args.rounds if args.rounds is not None else (QUICK_ROUNDS if args.quick else FULL_ROUNDS),
        anchors=args.anchors,
        chains=args.chains,
        stages=args.chain_stages,
        workers=args.chain_workers,
        edge_mbit=args.edge_mbit,
        quick=args.quick,
        shaped=args.shaped,
    )
    return run_demo(options)
