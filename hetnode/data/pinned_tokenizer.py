"""The run's pinned tokenizer on this machine: a tokenizer that travels with the run.

A run that sets `data.tokenizer_sha256` names its BPE by the sha256 of its `tokenizers` JSON, in the signed
manifest. A peer's copy is the run's only when its bytes hash to that pin: the `tokenizer.json` of its
`tokens:` folder, or the file `tokenizer-<sha256>.json` in its data cache, which a joining peer fetches from
the coordinator (`hetnode/daemon/run_tokenizer.py`) instead of training a BPE of its own. Whatever holds the
pinned copy uses it; one trained here (a coordinator's, `hetnode train`'s) must hash to the pin too, or the
peers, which take the coordinator's, would map text to other ids than it does.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

from hetnode.config import DataConfig
from hetnode.data.sources import parse_source
from hetnode.data.tokenizer import BpeTokenizer, Tokenizer
from hetnode.errors import DataError

TOKENIZER_FILE = "tokenizer.json"  # beside a prepared `tokens:` folder's shards (`prepared.py`)


class TokenizerMismatch(DataError):
    """A tokenizer file whose sha256 is not the run's `data.tokenizer_sha256`."""

    def __init__(self, where: str, found: str, pinned: str) -> None:
        self.found = found
        self.pinned = pinned
        super().__init__(
            f"{where}: sha256 {found} is not the run's data.tokenizer_sha256 {pinned}: another tokenizer"
        )


def is_pinned(cfg: DataConfig) -> bool:
    return cfg.tokenizer == "bpe" and bool(cfg.tokenizer_sha256)


def pinned_path(data_dir: Path, sha256: str) -> Path:
    """Where the data cache keeps the tokenizer of that hash (beside trained `bpe-….json`, where token
    shards' manifests name their tokenizer file)."""
    return Path(data_dir) / f"tokenizer-{sha256}.json"


def file_sha256(path: Path) -> str:
    with path.open("rb") as fh:
        return hashlib.file_digest(fh, "sha256").hexdigest()


def text_sha256(text: str) -> str:
    """The sha256 of `text` as a tokenizer file holds it (what `BpeTokenizer.save` writes)."""
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def fetch_target(cfg: DataConfig, data_dir: Path) -> Path | None:
    """Where the run's pinned tokenizer must be fetched to, or None when there is nothing to fetch: the byte
    tokenizer or no pin (the BPE is trained here, as before), a `tokens:` folder with a tokenizer of its own
    (its shards were cut with that one: it is used or refused, never replaced), or a cached copy of the
    pinned hash. A cached copy of another hash (damaged) is fetched again over it."""
    if not is_pinned(cfg):
        return None
    kind, folder = parse_source(cfg.source)
    if kind == "tokens" and folder is not None and (folder / TOKENIZER_FILE).is_file():
        return None
    path = pinned_path(data_dir, cfg.tokenizer_sha256)
    if path.is_file() and file_sha256(path) == cfg.tokenizer_sha256:
        return None
    return path


def adopt(candidate: Path, cfg: DataConfig, data_dir: Path, where: str) -> Path:
    """Take the file `candidate` (fetched from `where`) as the run's tokenizer: its sha256 must be the pin
    (TokenizerMismatch names both) and it must load as a BPE with end-of-text (DataError). It is then
    renamed into the data cache under its hash, atomically: a reader finds no copy or the whole one."""
    found = file_sha256(candidate)
    if found != cfg.tokenizer_sha256:
        raise TokenizerMismatch(where, found, cfg.tokenizer_sha256)
    path = pinned_path(data_dir, found)
    try:  # the pin names it, yet a file no one can read is no tokenizer
        BpeTokenizer.load(candidate, path.stem)
    except DataError:
        raise DataError(f"{where}: the pinned hash names no BPE tokenizer hetnode can use") from None
    path.parent.mkdir(parents=True, exist_ok=True)
    os.replace(candidate, path)  # the same file system: `candidate` is written in `data_dir`
    return path


def load_pinned(cfg: DataConfig, data_dir: Path, name: str | None = None) -> BpeTokenizer | None:
    """The cached copy of the run's pinned tokenizer, called `name` (default: its file's); None when there is
    none (or no pin). A copy whose bytes no longer hash to the pin is refused by name."""
    if not is_pinned(cfg):
        return None
    path = pinned_path(data_dir, cfg.tokenizer_sha256)
    if not path.is_file():
        return None
    found = file_sha256(path)
    if found != cfg.tokenizer_sha256:
        raise DataError(
            f"{path}: damaged (sha256 {found}, its name says {cfg.tokenizer_sha256}); delete it, and "
            "`hetnode join` fetches the run's tokenizer again"
        )
    return BpeTokenizer.load(path, name or path.stem)


def check_trained(cfg: DataConfig, tokenizer: Tokenizer, data_dir: Path) -> None:
    """A BPE trained here under a pin must be the pinned one: else DataError naming both hashes."""
    if not is_pinned(cfg) or not isinstance(tokenizer, BpeTokenizer):
        return
    found = text_sha256(tokenizer.to_json())
    if found != cfg.tokenizer_sha256:
        raise DataError(
            f"the BPE trained here on {cfg.source} has sha256 {found}, not the run's data.tokenizer_sha256 "
            f"{cfg.tokenizer_sha256}: its ids would mean other words. Put the run's tokenizer at "
            f"{pinned_path(data_dir, cfg.tokenizer_sha256)} (`hetnode join` fetches it from the "
            "coordinator), or set data.tokenizer_sha256 to the hash of the tokenizer this run trains"
        )
