"""`hetnode export` and `hetnode sample`: the global model out of a run, from a checkpoint folder or a
running coordinator's URL, as a Hugging Face folder or as text."""

from __future__ import annotations

import argparse
import importlib.util
import logging
import math
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from hetnode.errors import ConfigError
from hetnode.export.limits import DEFAULT_MAX_BYTES, DEFAULT_TIMEOUT_S
from hetnode.service.http_download import one_line

if TYPE_CHECKING:  # torch comes in the handlers, so that `hetnode --help` does not wait for it
    from hetnode.export.source import Checkpoint

log = logging.getLogger(__name__)

MAX_TOKENS = 4096
MAX_TIMEOUT_S = 7 * 24 * 3600.0
MAX_DOWNLOAD_MB = 1 << 20  # 1 TiB: past any model, and past nothing a typo could mean


def register(commands: argparse._SubParsersAction) -> None:
    export = commands.add_parser(
        "export", help="write the global model as a Hugging Face folder (safetensors, config, tokenizer)"
    )
    _source_flags(export)
    export.add_argument("--format", choices=("hf",), default="hf", help="hf: LlamaForCausalLM (default)")
    export.add_argument("--out", required=True, type=Path, help="folder to write (created)")
    export.add_argument("--force", action="store_true", help="write into a folder that is not empty")
    export.set_defaults(handler=run_export)

    sample = commands.add_parser("sample", help="print a continuation of a prompt from the global model")
    _source_flags(sample)
    sample.add_argument("--prompt", required=True, help="text to continue")
    sample.add_argument("--tokens", type=int, default=200, help=f"new tokens, 1..{MAX_TOKENS} (default 200)")
    sample.add_argument("--temperature", type=float, default=0.8, help="0 is greedy (default 0.8)")
    sample.add_argument("--seed", type=int, default=0, help="seed of the draws: same seed, same text")
    sample.set_defaults(handler=run_sample)


def _source_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--from",
        dest="source",
        required=True,
        metavar="CHECKPOINT_OR_URL",
        help="a checkpoint folder, a `hetnode train` run folder (runs/NAME), a coordinator's data dir (the "
        "newest checkpoint in its checkpoints/), or a coordinator URL http://host:port",
    )
    parser.add_argument(
        "--tokenizer",
        type=Path,
        default=None,
        help="a BPE run's tokenizer JSON (default: the one served with the checkpoint or kept beside it; "
        "for a local checkpoint without one, rebuilt from the run's data config, as peers do)",
    )
    parser.add_argument(
        "--timeout",
        type=float,
        default=DEFAULT_TIMEOUT_S,
        help=f"seconds the whole download may take (URL only; default {DEFAULT_TIMEOUT_S:.0f})",
    )
    parser.add_argument(
        "--max-download-mb",
        type=int,
        default=DEFAULT_MAX_BYTES >> 20,
        help=f"the most a URL's checkpoint may write to disk, in MiB (default {DEFAULT_MAX_BYTES >> 20})",
    )


def _open(args: argparse.Namespace) -> Checkpoint:
    from hetnode.export.source import open_checkpoint

    if not 0 < args.timeout <= MAX_TIMEOUT_S:  # NaN fails too
        raise ConfigError(
            "--timeout", "timeout", f"must be in (0, {MAX_TIMEOUT_S:.0f}] seconds, got {args.timeout}"
        )
    if not 1 <= args.max_download_mb <= MAX_DOWNLOAD_MB:
        raise ConfigError(
            "--max-download-mb",
            "max_download_mb",
            f"must be in 1..{MAX_DOWNLOAD_MB}, got {args.max_download_mb}",
        )
    checkpoint = open_checkpoint(
        args.source,
        timeout_s=args.timeout,
        max_bytes=args.max_download_mb << 20,
        with_tokenizer=args.tokenizer is None,
    )
    m = checkpoint.manifest
    run = one_line(m.run or "?", 80)  # a coordinator's words: no escapes reach the terminal
    log.info("checkpoint of run %s, %s, from %s", run, checkpoint.held(), checkpoint.where)
    return checkpoint


def run_export(args: argparse.Namespace) -> int:
    from hetnode.export.hf import write_hf
    from hetnode.export.source import run_tokenizer
    from hetnode.replica.global_model import base_fixed_embedding

    out: Path = args.out
    if out.exists() and not out.is_dir():
        raise ConfigError("--out", "out", f"{out} exists and is not a folder")
    if out.is_dir() and any(out.iterdir()) and not args.force:
        raise ConfigError("--out", "out", f"{out} is not empty (add --force to write into it)")
    checkpoint = _open(args)
    config = checkpoint.config
    tokenizer = run_tokenizer(checkpoint, args.tokenizer)
    fixed = base_fixed_embedding(config)
    written = write_hf(out, checkpoint.params, config, fixed, tokenizer, checkpoint.provenance())
    print(f"exported {checkpoint.held()} ({tokenizer.name} tokenizer) to {out}:")
    for path in written:
        print(f"  {path.name}")
    print(
        f"load it with AutoModelForCausalLM.from_pretrained({str(out)!r}) and AutoTokenizer.from_pretrained"
    )
    if importlib.util.find_spec("transformers") is None:
        print(
            "(transformers is not installed here: the folder was written without it, and loads where it is)"
        )
    return 0


def run_sample(args: argparse.Namespace) -> int:
    from hetnode.export.source import load_global_model, run_tokenizer
    from hetnode.model.sampling import sample_tokens

    if not 1 <= args.tokens <= MAX_TOKENS:
        raise ConfigError("--tokens", "tokens", f"must be in 1..{MAX_TOKENS}, got {args.tokens}")
    if not (math.isfinite(args.temperature) and args.temperature >= 0):
        raise ConfigError("--temperature", "temperature", f"must be finite and >= 0, got {args.temperature}")
    if not 0 <= args.seed < 2**63:
        raise ConfigError("--seed", "seed", f"must be in 0..2^63-1, got {args.seed}")
    checkpoint = _open(args)
    tokenizer = run_tokenizer(checkpoint, args.tokenizer)
    prompt = tokenizer.encode(args.prompt)
    if not prompt:
        raise ConfigError("--prompt", "prompt", f"{args.prompt!r} encodes to no tokens")
    model = load_global_model(checkpoint)
    ids = sample_tokens(model, prompt, args.tokens, args.temperature, args.seed, stop_id=tokenizer.eos_id)
    sys.stdout.write(args.prompt + tokenizer.decode(ids) + "\n")  # the prompt as given, then what follows
    return 0
