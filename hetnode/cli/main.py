"""`hetnode` entry point: parse the subcommand, set up logging once, map errors to exit codes.

Every subcommand module registers its parser with light imports only (argparse, paths, constants) and
imports torch, hivemind or matplotlib inside its handler, so `hetnode --help` answers at once
(tests/cli/test_light_imports.py holds it)."""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence

from hetnode import __version__
from hetnode.cli import bench, data, demo, swarm, train, use_model
from hetnode.errors import (
    ConfigError,
    DataConfigError,
    HetnodeError,
    RefusedAnswer,
    SetupMismatch,
    Stopped,
)

EXIT_ERROR = 1
EXIT_USAGE = 2  # bad config, arguments or data config, or an answer from a URL asking again will not mend
EXIT_INTERRUPTED = 130  # as a shell reports a command ended by Ctrl+C

SUBCOMMANDS = (demo, train, data, bench, swarm, use_model)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="hetnode",
        description="Decentralised heterogeneous pre-training: anchors, compressed chains, SparseLoCo sync.",
    )
    parser.add_argument("--version", action="version", version=f"hetnode {__version__}")
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for module in SUBCOMMANDS:
        module.register(commands)
    return parser


def setup_logging(verbose: bool, prefix: str = "hetnode") -> None:
    logging.basicConfig(
        level=logging.DEBUG if verbose else logging.INFO,
        format=f"%(asctime)s {prefix} %(levelname)s %(name)s: %(message)s",
        datefmt="%H:%M:%S",
        stream=sys.stderr,
    )


def config_error_text(exc: ConfigError) -> str:
    """A flag's error names the flag once ("--bandwidth: must be ..."); a config file's error names the
    file and the key at fault ("config error: configs/x.toml: model.dim: ...")."""
    if exc.path.startswith("-"):
        return f"{exc.path}: {exc.message}"
    return f"config error: {exc}"


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    setup_logging(args.verbose)
    try:
        return int(args.handler(args) or 0)
    except ConfigError as exc:
        print(f"hetnode: {config_error_text(exc)}", file=sys.stderr)
        return EXIT_USAGE
    except DataConfigError as exc:  # the data has no such column or path: edit the config, do not restart
        print(f"hetnode: data config error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except (RefusedAnswer, SetupMismatch) as exc:  # what no retry will mend (a URL's answer, the data dir)
        print(f"hetnode: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except Stopped as exc:  # a one-shot command (status) stopped by Ctrl+C or SIGTERM while it waited
        print(f"hetnode: interrupted ({exc})", file=sys.stderr)
        return EXIT_INTERRUPTED
    except HetnodeError as exc:
        print(f"hetnode: {exc}", file=sys.stderr)
        return EXIT_ERROR
    except KeyboardInterrupt:
        print("hetnode: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED


if __name__ == "__main__":
    sys.exit(main())
