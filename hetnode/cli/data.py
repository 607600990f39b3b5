"""`hetnode data prepare`: tokenise a large text source once, offline, into a folder every peer copies.

The run then trains on `tokens:<folder>` with its tokenizer pinned by sha256 (`hetnode/data/prepared.py`);
docs/operations.md, "A large corpus", is the recipe."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from hetnode.config import load_config, replace
from hetnode.errors import ConfigError

DEFAULT_BPE_DOCUMENTS = 200_000  # FineWeb's ~3 kB documents: ~600 MB of text in memory while the BPE learns


def register(commands: argparse._SubParsersAction) -> None:
    data = commands.add_parser("data", help="prepare a run's data offline (tokenise a large corpus once)")
    actions = data.add_subparsers(dest="data_command", metavar="ACTION", required=True)
    prepare = actions.add_parser(
        "prepare", help="train the BPE on N documents and tokenise a text source into shards + tokenizer.json"
    )
    prepare.add_argument("--config", required=True, type=Path, help="the run config (its [data] section)")
    prepare.add_argument(
        "--source", required=True, help="the text to tokenise, e.g. parquet:/srv/fineweb (any text source)"
    )
    prepare.add_argument("--out", required=True, type=Path, help="a new folder for the shards and tokenizer")
    prepare.add_argument(
        "--bpe-documents",
        type=int,
        default=DEFAULT_BPE_DOCUMENTS,
        help="the BPE learns from the first N training documents (default %(default)s)",
    )
    prepare.add_argument(
        "--max-documents", type=int, default=None, help="tokenise at most N documents (default: the config's)"
    )
    prepare.add_argument("--text-column", default=None, help="the text column (default: the config's)")
    prepare.set_defaults(handler=run_prepare)


def run_prepare(args: argparse.Namespace) -> int:
    from hetnode.data.prepared import prepare_tokens  # tokenizers, pyarrow: here, so `--help` is quick

    if args.bpe_documents < 1:
        raise ConfigError("--bpe-documents", "bpe_documents", f"must be >= 1, got {args.bpe_documents}")
    if args.max_documents is not None and args.max_documents < 0:
        raise ConfigError("--max-documents", "data.max_documents", f"must be >= 0, got {args.max_documents}")
    config = load_config(args.config)
    changes: dict = {"source": args.source}
    if args.max_documents is not None:
        changes["max_documents"] = args.max_documents
    if args.text_column is not None:
        changes["text_column"] = args.text_column
    try:
        data = replace(config, "data", **changes).data
    except ConfigError as exc:  # named by its flag, not by "<override>"
        raise ConfigError(f"--{exc.key.split('.')[-1].replace('_', '-')}", exc.key, exc.message) from None
    out = args.out.expanduser().resolve()
    manifest = prepare_tokens(data, out, args.bpe_documents, Path(data.data_dir).expanduser())
    tok = manifest["tokenizer"]
    docs = manifest["documents"]
    print(
        f"prepared {out}: {manifest['train']['tokens']:,} train / {manifest['eval']['tokens']:,} eval tokens "
        f"from {docs['train']:,} / {docs['eval']:,} documents; "
        f"tokenizer {tok['name']} ({tok['vocab_size']} ids)"
    )
    print(f"put in the run config ({args.config}):")
    print("[data]")
    print(f"source = {json.dumps(f'tokens:{out}')}")  # a JSON string is a TOML basic string
    if "sha256" in tok:
        print(f'tokenizer_sha256 = "{tok["sha256"]}"')
    print("each peer copies the folder and joins with --data-source tokens:<its copy>")
    return 0
