"""`hetnode bench NAME`: side-by-side benchmarks that write JSON + PNG results."""

from __future__ import annotations

import argparse
from pathlib import Path

from hetnode.bench.sparseloco import plan_for, run_benchmark
from hetnode.config import load_config

CONFIG_DIR = Path(__file__).resolve().parents[2] / "configs"


def register(commands: argparse._SubParsersAction) -> None:
    parser = commands.add_parser("bench", help="run a benchmark (results as JSON + PNG)")
    benches = parser.add_subparsers(dest="bench", metavar="BENCH", required=True)
    sparse = benches.add_parser("sparseloco", help="DDP vs DiLoCo vs SparseLoCo: loss against bytes")
    sparse.add_argument("--quick", action="store_true", help="tiny config, 2 replicas (a few minutes)")
    sparse.add_argument(
        "--config", type=Path, default=None, help="run config (default: tiny if --quick, else small)"
    )
    sparse.add_argument("--out", type=Path, default=Path("benchmarks/results"), help="output folder")
    sparse.add_argument("--no-progress", action="store_true")
    sparse.set_defaults(handler=run_sparseloco)


def run_sparseloco(args: argparse.Namespace) -> int:
    config_path = args.config or CONFIG_DIR / ("tiny.toml" if args.quick else "small.toml")
    config = load_config(config_path)
    report = run_benchmark(config, plan_for(args.quick), args.out, progress=not args.no_progress)
    header = ("method", "eval loss", "bytes/round", "total bytes", "vs fp32", "codec/inner")
    print("{:<22} {:>9} {:>12} {:>12} {:>8} {:>11}".format(*header))
    for name, r in report["methods"].items():
        ratio = r["codec_over_inner"]
        print(
            f"{name:<22} {r['final_eval_loss']:>9.4f} {r['bytes_per_replica_per_round']:>12,.0f} "
            f"{r['bytes_per_replica_total']:>12,.0f} {r['compression_vs_dense_fp32']:>7.1f}x "
            f"{(ratio or 0) * 100:>10.2f}%"
        )
    print(f"wrote {args.out / 'sparseloco.json'} and {args.out / 'sparseloco.png'}")
    return 0
