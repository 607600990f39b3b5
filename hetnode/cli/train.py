"""`hetnode train`: one local replica, no network (the inner loop every role reuses)."""

from __future__ import annotations

import argparse
import json
import logging
import math
from pathlib import Path

from hetnode.cli.device import check_device
from hetnode.config import load_config, replace
from hetnode.errors import ConfigError

log = logging.getLogger(__name__)


def register(commands: argparse._SubParsersAction) -> None:
    parser = commands.add_parser("train", help="train one local replica (no network)")
    parser.add_argument(
        "--config", required=True, type=Path, help="run config (TOML), e.g. configs/tiny.toml"
    )
    parser.add_argument("--max-steps", type=int, default=None, help="override train.max_steps")
    parser.add_argument("--out", type=Path, default=None, help="output folder (default runs/<run name>)")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument(
        "--resume",
        action="store_true",
        help="continue from the newest checkpoint in <out>/checkpoints/ (an old <out>/checkpoint.pt is "
        "converted to it once)",
    )
    parser.add_argument("--no-progress", action="store_true", help="no progress bar (logs only)")
    parser.add_argument(
        "--allow-repeats",
        action="store_true",
        help="train even when the steps pass over the data more than train.max_epochs times",
    )
    parser.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    from hetnode.training.local_run import run_local_training  # torch: here, so `hetnode --help` is quick

    config = load_config(args.config)
    if args.allow_repeats:
        config = replace(config, "train", max_epochs=0.0)
    if args.max_steps is not None and args.max_steps <= 0:
        raise ConfigError("--max-steps", "train.max_steps", f"must be > 0, got {args.max_steps}")
    check_device(args.device)
    out_dir = args.out or Path("runs") / config.run.name
    log.info("config %s (run %s); -v prints it whole", args.config, config.run.name)
    log.debug("effective config: %s", json.dumps(config.to_dict(), sort_keys=True))
    summary = run_local_training(
        config,
        out_dir,
        max_steps=args.max_steps,
        resume=args.resume,
        device=args.device,
        progress=not args.no_progress,
    )
    s = summary
    print(f"steps {s.steps}  tokens {s.tokens:,}  tokens/s {s.tokens_per_second:,.0f}")
    # NaN when no step was taken (a resume at its last step, as converting an old checkpoint is)
    trained = "-" if math.isnan(s.train_loss) else f"{s.train_loss:.4f}"
    print(f"train loss {trained}  eval loss {s.first_eval_loss:.4f} -> {s.eval_loss:.4f}")
    print(f"outputs: {s.out_dir}/metrics.jsonl  {s.out_dir}/loss.png  {s.checkpoint}/")
    print(f"sample it: hetnode sample --from {s.out_dir} --prompt TEXT")
    print(f"export it: hetnode export --from {s.out_dir} --out DIR (a Hugging Face folder)")
    return 0
