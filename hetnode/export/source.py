"""Open the global model from where a user has it: a checkpoint folder (or a folder of them), or a running
coordinator's URL; and the run's tokenizer. Shared by `hetnode export` and `hetnode sample`.

A coordinator serves its latest checkpoint as `GET /api/checkpoint/manifest.json` and
`GET /api/checkpoint/model.safetensors`. Both replies are untrusted input: their sizes are bounded before
they are read (a manifest by the checkpoint format's limit, the weights by what the manifest's config
implies), every read has a timeout, and the two files are checked to belong together (same round, layer
digests) before anything uses them. A new checkpoint written between the two requests is retried.
"""

from __future__ import annotations

import http.client
import json
import logging
import tempfile
import time
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from hetnode.config import Config, config_from_dict
from hetnode.data.dataset import TokenDataset
from hetnode.data.tokenizer import BpeTokenizer, ByteTokenizer, Tokenizer
from hetnode.errors import CheckpointError, ConfigError, DataError
from hetnode.export.hf import check_params
from hetnode.model.decoder import DecoderStage, build_model, count_parameters
from hetnode.replica.checkpoint import (
    MANIFEST,
    MAX_MANIFEST_BYTES,
    WEIGHTS,
    CheckpointManifest,
    latest_checkpoint,
    load_checkpoint,
    manifest_from_dict,
)
from hetnode.replica.global_model import base_fixed_embedding

log = logging.getLogger(__name__)

API = "/api/checkpoint/"
HEADER_SLACK = 1 << 20  # the safetensors JSON header: names, shapes and offsets, kilobytes in practice
CHUNK = 1 << 20
ATTEMPTS = 3  # a checkpoint written between our two requests makes the pair disagree: fetch again
RETRY_S = 0.5


class _Busy(CheckpointError):
    """HTTP 503: the coordinator is rewriting its checkpoints; asking again shortly is the answer."""


@dataclass(frozen=True)
class Checkpoint:
    """θ (float32 by global name), its manifest, the run config rebuilt from it, and where it came from."""

    params: dict[str, torch.Tensor]
    manifest: CheckpointManifest
    config: Config
    where: str

    def provenance(self) -> dict[str, object]:
        m = self.manifest
        return {"source": self.where, "run": m.run, "round": m.round, "config_hash": m.config_hash}


def is_url(source: str) -> bool:
    return source.startswith(("http://", "https://"))


def open_checkpoint(source: str, timeout_s: float = 30.0) -> Checkpoint:
    """The checkpoint at `source`: a coordinator URL (`http://host:port`), a checkpoint folder, or a folder
    of `round-*` checkpoints (the newest is taken). CheckpointError when it is absent, damaged or does not
    match its own config."""
    if is_url(source):
        return fetch_checkpoint(source, timeout_s)
    folder = Path(source).expanduser()
    if not folder.is_dir():
        raise CheckpointError(f"{folder}: no such checkpoint folder")
    if not (folder / MANIFEST).exists():
        folder = latest_checkpoint(folder) or folder  # a coordinator's checkpoints/ folder
    params, manifest = load_checkpoint(folder)
    return _checked(params, manifest, str(folder))


def fetch_checkpoint(url: str, timeout_s: float = 30.0) -> Checkpoint:
    """Download a coordinator's latest checkpoint into a temporary folder and open it from there."""
    base = _base_url(url)
    for attempt in range(1, ATTEMPTS + 1):
        with tempfile.TemporaryDirectory(prefix="hetnode-checkpoint-") as tmp:
            folder = Path(tmp)
            try:
                _get(base + "manifest.json", folder / MANIFEST, MAX_MANIFEST_BYTES, timeout_s)
            except _Busy:
                if attempt == ATTEMPTS:
                    raise
                time.sleep(RETRY_S * attempt)
                continue
            manifest = _parse_manifest((folder / MANIFEST).read_bytes(), base + "manifest.json")
            config = _config(manifest, base + "manifest.json")
            limit = 4 * count_parameters(config.model) + HEADER_SLACK
            try:
                _get(base + WEIGHTS, folder / WEIGHTS, limit, timeout_s)
            except _Busy:
                if attempt == ATTEMPTS:
                    raise
                time.sleep(RETRY_S * attempt)
                continue
            stored = _weights_round(folder / WEIGHTS)
            if stored is not None and stored != str(manifest.round):
                log.info(
                    "%s: weights of round %s, manifest of %s; fetching again", url, stored, manifest.round
                )
                continue
            # same round, same θ: a digest mismatch now is damage, not a race, and is not retried
            params, manifest = load_checkpoint(folder)
            return _checked(params, manifest, url)
    raise CheckpointError(f"{url}: the manifest and the weights kept naming different rounds")


def load_global_model(checkpoint: Checkpoint) -> DecoderStage:
    """The whole model holding θ, in eval mode, with T_fix at the input when the run compresses."""
    config = checkpoint.config
    model = build_model(config.model, seed=config.run.seed)
    model.load_state_dict(checkpoint.params, strict=True)  # names and shapes were checked on open
    model.fixed_embedding = base_fixed_embedding(config)
    return model.eval()


def run_tokenizer(config: Config, path: Path | None = None) -> Tokenizer:
    """The tokenizer the run trained with. Bytes need nothing. A BPE comes from `path` (its `tokenizers`
    JSON, e.g. `bpe-….json` from a peer's data dir) or, without one, is rebuilt exactly as every peer
    builds it, by the same code (`TokenDataset.build`): trained on the run's training documents
    (deterministic), or taken from this machine's data-dir cache of that training."""
    if config.data.tokenizer == "bytes":
        if path is not None:
            raise DataError(f"{path}: the run uses the byte tokenizer, which has no file; drop --tokenizer")
        return ByteTokenizer()
    if path is not None:
        path = Path(path).expanduser()
        if not path.is_file():
            raise DataError(f"{path}: no such tokenizer file")
        tokenizer: Tokenizer = BpeTokenizer.load(path, path.stem)
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
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CheckpointError(f"{where}: not a JSON manifest ({exc})") from None
    return manifest_from_dict(doc, where)


def _weights_round(path: Path) -> str | None:
    try:
        with safe_open(str(path), framework="pt") as f:
            return (f.metadata() or {}).get("round")
    except (SafetensorError, OSError) as exc:
        raise CheckpointError(f"{path.name} from the coordinator is not a safetensors file ({exc})") from None


def _base_url(url: str) -> str:
    parts = urllib.parse.urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise CheckpointError(f"{url!r} is not a coordinator URL (expected http://host:port)")
    if parts.query or parts.fragment:
        raise CheckpointError(f"{url!r}: a coordinator URL has no query or fragment")
    return urllib.parse.urlunsplit((parts.scheme, parts.netloc, parts.path.rstrip("/") + API, "", ""))


def _get(url: str, dest: Path, limit: int, timeout_s: float) -> None:
    """GET `url` into `dest`, refusing more than `limit` bytes.
    `timeout_s` bounds the connection and every read, so a stalled coordinator cannot hang us."""
    request = urllib.request.Request(url, headers={"Accept": "*/*", "User-Agent": "hetnode"})
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as reply:
            declared = reply.headers.get("Content-Length")
            if declared is not None and declared.isdigit() and int(declared) > limit:
                raise CheckpointError(
                    f"{url}: reply of {int(declared):,} bytes, more than the {limit:,} allowed"
                )
            size = 0
            with open(dest, "wb") as out:
                while chunk := reply.read(min(CHUNK, limit + 1 - size)):
                    size += len(chunk)
                    if size > limit:
                        raise CheckpointError(f"{url}: reply longer than the {limit:,} bytes allowed")
                    out.write(chunk)
    except urllib.error.HTTPError as exc:
        said = _error_text(exc)
        if exc.code == 503:
            raise _Busy(f"{url}: HTTP 503 {said or exc.reason}") from None
        if exc.code == 404 and not said:
            said = "no checkpoint here (none written yet, or a coordinator too old to serve one)"
        raise CheckpointError(f"{url}: HTTP {exc.code} {said or exc.reason}") from None
    except urllib.error.URLError as exc:
        raise CheckpointError(f"{url}: cannot reach the coordinator ({exc.reason})") from None
    except (OSError, http.client.HTTPException) as exc:  # timeouts, resets, replies cut short
        raise CheckpointError(f"{url}: the download failed ({exc!r})") from None


def _error_text(exc: urllib.error.HTTPError) -> str:
    """The coordinator's `{"error": "..."}` reply body, when it sent one (read at most 4 KiB of it)."""
    try:
        doc = json.loads(exc.read(4096).decode("utf-8"))
    except (OSError, ValueError, http.client.HTTPException):
        return ""
    error = doc.get("error") if isinstance(doc, dict) else None
    return error[:300] if isinstance(error, str) else ""
