"""Open the global model from where a user has it: a checkpoint folder, a `hetnode train` run's folder or a
coordinator's data dir (`locate.py` tells which), or a running coordinator's URL; and the run's tokenizer.
Shared by `hetnode export` and `hetnode sample`.

A coordinator serves its latest checkpoint as `GET /api/checkpoint/manifest.json` and
`GET /api/checkpoint/model.safetensors`, and a BPE run's tokenizer as `GET /api/checkpoint/tokenizer.json`.
Whoever answers at a URL is a stranger, and all of it is data, never instructions (`download.py`, over
`hetnode/service/http_download.py`, holds the byte and time budgets): the weights may not exceed what the
manifest's config implies nor `--max-download-mb`, everything must arrive within `--timeout`, every malformed
answer is a one-line RefusedAnswer (the CLI exits 2: asking again gets the same), and the files are checked to
belong together (same round, layer digests) before anything uses them; what may pass (unreachable, too slow,
busy, cut short, no checkpoint yet) is a plain CheckpointError (exit 1). A new checkpoint written between the
requests is fetched again. No local path is ever taken from a remote manifest: its `data.source` and
`data_dir` are never opened (see `run_tokenizer`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import tempfile
import urllib.parse
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from hetnode.config import Config, config_from_dict
from hetnode.data.dataset import TokenDataset
from hetnode.data.tokenizer import BpeTokenizer, ByteTokenizer, Tokenizer
from hetnode.errors import CheckpointError, ConfigError, DataError, RefusedAnswer
from hetnode.export.download import budget as download_budget
from hetnode.export.download import fetch
from hetnode.export.hf import check_params
from hetnode.export.limits import DEFAULT_MAX_BYTES, DEFAULT_TIMEOUT_S
from hetnode.export.locate import checkpoint_folder
from hetnode.export.tokenizer_file import bpe_from_json, tokenizer_beside
from hetnode.model.decoder import DecoderStage, build_model, count_parameters
from hetnode.replica.checkpoint import (
    MANIFEST,
    MAX_MANIFEST_BYTES,
    MAX_TOKENIZER_BYTES,
    TOKENIZER_FILE,
    WEIGHTS,
    CheckpointManifest,
    load_checkpoint,
    manifest_from_dict,
)
from hetnode.replica.global_model import base_fixed_embedding
from hetnode.service.http_download import Budget, one_line

log = logging.getLogger(__name__)

API = "/api/checkpoint/"
HEADER_SLACK = 1 << 20  # the safetensors JSON header: names, shapes and offsets, kilobytes in practice
ATTEMPTS = 3  # a checkpoint written between our requests makes the pair disagree: fetch again
NO_TOKENIZER = "no tokenizer here (a coordinator too old to serve one)"
MALFORMED = (ValueError, TypeError, KeyError, OverflowError, RecursionError)  # what odd input raises


@dataclass(frozen=True)
class Checkpoint:
    """θ (float32 by global name), its manifest, the run config rebuilt from it, where it came from, and
    the run's BPE tokenizer when one came with it (served by the coordinator, or beside the folder)."""

    params: dict[str, torch.Tensor]
    manifest: CheckpointManifest
    config: Config
    where: str
    tokenizer: BpeTokenizer | None = None

    def held(self) -> str:
        """What θ this is, in words: "θ after round 7", or "θ after step 300 of `hetnode train`"."""
        m = self.manifest
        step, local = m.extra.get("step"), m.extra.get("trained_by") == "hetnode train"
        if local and isinstance(step, int) and not isinstance(step, bool):
            return f"θ after step {step} of `hetnode train`"  # a local run has steps, not rounds
        return f"θ after round {m.round}"

    def provenance(self) -> dict[str, object]:
        m = self.manifest
        return {"source": self.where, "run": m.run, "round": m.round, "config_hash": m.config_hash}


def is_url(source: str) -> bool:
    return source.startswith(("http://", "https://"))


def open_checkpoint(
    source: str,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    max_bytes: int = DEFAULT_MAX_BYTES,
    with_tokenizer: bool = True,
) -> Checkpoint:
    """The checkpoint at `source`: a coordinator URL (`http://host:port`) or a local path (`locate.py`: a
    checkpoint folder, a `hetnode train` run folder, a coordinator's data dir; the newest is taken).
    ConfigError when the path names no checkpoint; CheckpointError when it is damaged or does not match its
    own config (a RefusedAnswer when a URL's answer is at fault). `with_tokenizer`: bring a BPE run's
    tokenizer too (off when the user has one)."""
    if is_url(source):
        return fetch_checkpoint(source, timeout_s, max_bytes, with_tokenizer)
    folder = checkpoint_folder(source)  # a run folder, a data dir, a file in a checkpoint: said in the log
    params, manifest = load_checkpoint(folder)
    checkpoint = _checked(params, manifest, str(folder))
    if with_tokenizer and checkpoint.config.data.tokenizer == "bpe":
        tokenizer = tokenizer_beside(folder, checkpoint.config.model.vocab_size)
        checkpoint = dataclasses.replace(checkpoint, tokenizer=tokenizer)
    return checkpoint


def fetch_checkpoint(
    url: str,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    max_bytes: int = DEFAULT_MAX_BYTES,
    with_tokenizer: bool = True,
) -> Checkpoint:
    """Download a coordinator's latest checkpoint (and a BPE run's tokenizer, `with_tokenizer`) into a
    temporary folder, within `timeout_s` seconds and `max_bytes` bytes, and open it from there."""
    budget = download_budget(timeout_s, max_bytes)
    try:
        return _fetch(url, _base_url(url), budget, with_tokenizer)
    except CheckpointError as exc:  # may quote the sender's words: one printable line
        kind = RefusedAnswer if isinstance(exc, RefusedAnswer) else CheckpointError
        raise kind(one_line(str(exc))) from None
    except MALFORMED as exc:
        why = one_line(f"{type(exc).__name__}: {exc}", 200)
        raise RefusedAnswer(f"{url}: the coordinator's answer is malformed ({why})") from None


def _fetch(url: str, base: str, budget: Budget, with_tokenizer: bool) -> Checkpoint:
    tokenizer = None
    for _ in range(ATTEMPTS):
        with tempfile.TemporaryDirectory(prefix="hetnode-checkpoint-") as tmp:
            folder = Path(tmp)
            manifest_limit = min(MAX_MANIFEST_BYTES, budget.max_bytes)
            fetch(base + MANIFEST, folder / MANIFEST, manifest_limit, budget)
            with _refused():
                manifest = _parse_manifest((folder / MANIFEST).read_bytes(), base + MANIFEST)
                config = _config(manifest, base + MANIFEST)
            room = budget.max_bytes - (folder / MANIFEST).stat().st_size
            if with_tokenizer and config.data.tokenizer == "bpe" and tokenizer is None:
                # before the weights: a run whose tokenizer cannot come fails before gigabytes do
                tokenizer = _fetch_tokenizer(base + TOKENIZER_FILE, folder, config, budget, room)
                room -= (folder / TOKENIZER_FILE).stat().st_size
            fetch(base + WEIGHTS, folder / WEIGHTS, _weights_limit(url, config, room, budget), budget)
            stored = _weights_round(folder / WEIGHTS)
            if stored is not None and stored != str(manifest.round):
                log.info(
                    "%s: weights of round %s, manifest of %s; fetching again",
                    url,
                    one_line(stored, 40),
                    manifest.round,
                )
                continue
            # same round, same θ: a digest mismatch now is damage, not a race, and is not retried
            with _refused():
                params, manifest = load_checkpoint(folder)
                checkpoint = _checked(params, manifest, url)
            return dataclasses.replace(checkpoint, tokenizer=tokenizer)
    # a coordinator writing checkpoints faster than we fetch them: it may pass, so not a RefusedAnswer
    raise CheckpointError(f"{url}: the manifest and the weights kept naming different rounds")


def _fetch_tokenizer(url: str, folder: Path, config: Config, budget: Budget, room: int) -> BpeTokenizer:
    try:
        fetch(url, folder / TOKENIZER_FILE, min(MAX_TOKENIZER_BYTES, room), budget, NO_TOKENIZER)
    except CheckpointError as exc:  # of its kind: a 404 may pass (still being built), a flood will not
        kind = RefusedAnswer if isinstance(exc, RefusedAnswer) else CheckpointError
        raise kind(
            f"{exc}. The run uses a BPE tokenizer, which a remote config cannot make here: pass "
            f"--tokenizer FILE (the bpe-….json in a peer's data dir)"
        ) from None
    with _refused():
        return bpe_from_json((folder / TOKENIZER_FILE).read_bytes(), url, config.model.vocab_size)


def _weights_limit(url: str, config: Config, room: int, budget: Budget) -> int:
    """The most the weights may weigh: what the config implies, if the user's cap leaves room for it."""
    implied = 4 * count_parameters(config.model) + HEADER_SLACK
    if implied > room:
        raise RefusedAnswer(
            f"{url}: the manifest's config implies {_mib(implied)} of weights, more than --max-download-mb "
            f"{budget.max_bytes >> 20} leaves room for (raise it if you trust this coordinator)"
        )
    return implied


def _mib(size: int) -> str:
    return f"{size >> 20:,} MiB" if size < 1 << 60 else "more than an exbibyte"


def load_global_model(checkpoint: Checkpoint) -> DecoderStage:
    """The whole model holding θ, in eval mode, with T_fix at the input when the run compresses."""
    config = checkpoint.config
    model = build_model(config.model, seed=config.run.seed)
    model.load_state_dict(checkpoint.params, strict=True)  # names and shapes were checked on open
    model.fixed_embedding = base_fixed_embedding(config)
    return model.eval()


def run_tokenizer(checkpoint: Checkpoint, path: Path | None = None) -> Tokenizer:
    """The tokenizer the run trained with. Bytes need nothing. A BPE comes from `path` (the user's own
    `tokenizers` JSON, e.g. `bpe-….json` from a peer's data dir), else from the checkpoint (served by the
    coordinator, or beside the folder). Without either, a local checkpoint's BPE is rebuilt exactly as every
    peer builds it (`TokenDataset.build`: trained on the run's training documents, or this machine's cache
    of that). Never for a URL: a stranger's `data.source` and `data_dir` would have us read the user's own
    files, cache them into a folder of the stranger's choosing and learn them into the exported vocabulary."""
    config = checkpoint.config
    if config.data.tokenizer == "bytes":
        if path is not None:
            raise DataError(f"{path}: the run uses the byte tokenizer, which has no file; drop --tokenizer")
        return ByteTokenizer()
    if path is not None:
        path = Path(path).expanduser()
        if not path.is_file():
            raise DataError(f"{path}: no such tokenizer file")
        tokenizer: Tokenizer = BpeTokenizer.load(path, path.stem)
    elif checkpoint.tokenizer is not None:
        tokenizer = checkpoint.tokenizer
    elif is_url(checkpoint.where):
        raise CheckpointError(
            f"{checkpoint.where}: the run uses a BPE tokenizer and none came with the checkpoint: pass "
            f"--tokenizer FILE (the bpe-….json in a peer's data dir)"
        )
    else:
        log.info("rebuilding the run's BPE tokenizer from its data source %s", config.data.source)
        tokenizer = TokenDataset.build(config.data, config.model.vocab_size, config.run.seed).tokenizer
    if tokenizer.vocab_size > config.model.vocab_size:
        raise DataError(
            f"tokenizer {tokenizer.name} has {tokenizer.vocab_size} ids, more than the model's "
            f"{config.model.vocab_size}: it is not this run's tokenizer"
        )
    return tokenizer


def _checked(params: dict[str, torch.Tensor], manifest: CheckpointManifest, where: str) -> Checkpoint:
    config = _config(manifest, where)
    check_params(params, config.model, where)
    return Checkpoint(params, manifest, config, where)


def _config(manifest: CheckpointManifest, where: str) -> Config:
    try:
        return config_from_dict(manifest.config, source=where)
    except ConfigError as exc:  # the checkpoint is at fault, not the user's flags
        raise CheckpointError(f"{where}: the manifest's config is not valid ({exc})") from None


def _parse_manifest(raw: bytes, where: str) -> CheckpointManifest:
    try:
        doc = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:  # deep nesting is a RecursionError
        raise CheckpointError(f"{where}: not a JSON manifest ({type(exc).__name__}: {exc})") from None
    return manifest_from_dict(doc, where)


def _weights_round(path: Path) -> str | None:
    try:
        with safe_open(str(path), framework="pt") as f:
            return (f.metadata() or {}).get("round")
    except (SafetensorError, OSError) as exc:
        raise RefusedAnswer(f"{path.name} from the coordinator is not a safetensors file ({exc})") from None


@contextlib.contextmanager
def _refused() -> Iterator[None]:
    """Checks shared with local folders raise CheckpointError; on what a URL answered, their verdict is
    the answer's fault and will not change on asking again: RefusedAnswer."""
    try:
        yield
    except RefusedAnswer:
        raise
    except CheckpointError as exc:
        raise RefusedAnswer(str(exc)) from None


def _base_url(url: str) -> str:
    """The checkpoint API under the user's `--from`; a URL that cannot be one is the user's ConfigError."""
    try:
        parts = urllib.parse.urlsplit(url)
        usable = parts.scheme in ("http", "https") and bool(parts.hostname) and parts.port != 0
    except ValueError:  # a bracket left open, a port that is not one
        usable = False
    if not usable or not url.isprintable() or " " in url:  # http.client would refuse spaces and controls
        raise ConfigError("--from", "source", f"{url!r} is not a coordinator URL (expected http://host:port)")
    if parts.query or parts.fragment:
        raise ConfigError("--from", "source", f"{url!r}: a coordinator URL has no query or fragment")
    return urllib.parse.urlunsplit((parts.scheme, parts.netloc, parts.path.rstrip("/") + API, "", ""))
