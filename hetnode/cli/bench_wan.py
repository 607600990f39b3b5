"""`hetnode bench wan-check`: the lab's user-space WAN emulator measured against what it was asked (root)."""

from __future__ import annotations

import argparse
from pathlib import Path

from hetnode.errors import HetnodeError
from hetnode.lab.netlab.wan import PRESETS
from hetnode.lab.runs import wan_check


def register(benches: argparse._SubParsersAction) -> None:
    parser = benches.add_parser(
        "wan-check",
        help="RTT, loss and TCP rate through the lab's WAN emulator against each profile's (root)",
    )
    parser.add_argument(
        "--profiles",
        default=",".join(wan_check.CHECKED),
        help=f"comma-separated presets to measure (default: {','.join(wan_check.CHECKED)})",
    )
    parser.add_argument("--seconds", type=float, default=4.0, help="steady seconds per TCP transfer")
    parser.add_argument("--probes", type=int, default=2000, help="UDP echo probes per profile")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/wan"), help="output folder")
    parser.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    profiles = tuple(p for p in args.profiles.split(",") if p)
    unknown = [p for p in profiles if p not in PRESETS]
    if unknown or not profiles:
        raise HetnodeError(f"--profiles: unknown preset(s) {unknown}; presets: {', '.join(PRESETS)}")
    if not 0.5 <= args.seconds <= 600 or not 10 <= args.probes <= 100_000:
        raise HetnodeError("wan-check needs 0.5 <= --seconds <= 600 and 10 <= --probes <= 100000")
    wan_check.run_check(args.out, profiles, args.seconds, args.probes)
    print(f"wrote {args.out / 'wan.json'} and {args.out / 'wan.png'}")
    return 0
