"""The coordinator's θ on disk and on its HTTP port: `DATA_DIR/checkpoints/round-NNNNNN/` (the format is
`hetnode/replica/checkpoint.py`), written every `outer.checkpoint_every_rounds` rounds and on stop, the
newest `outer.keep_checkpoints` kept.

On start the coordinator takes θ from the newest checkpoint that loads whole (readable safetensors, finite
float32 values that hash to its manifest's layer digests, the config's shapes). A damaged newer one is
passed over with a warning and renamed `round-NNNNNN.damaged` (kept for a person to look at, never served
or counted again): it costs the rounds since the previous checkpoint, which the coordinator takes back from
the replicas (`round_keeper.py`), not the run. A checkpoint whose manifest names another run, or a config
that changes what θ means (`run_state.changes_meaning`), is refused instead: that is not damage but the
wrong data dir or the wrong `--config`, and nothing is changed.

A BPE run's tokenizer is kept beside the round folders as `checkpoints/tokenizer.json` (`keep_tokenizer`,
when the bookkeeping worker has built the corpus) and served with them: whoever exports θ over HTTP gets
the run's tokenizer from the coordinator, never by rebuilding it from a data config that names paths.

An old `global.pt` (a pickle of earlier versions) is read with `weights_only=True` (no code runs), written
in this format, read back, and renamed `global.pt.converted`, once.
"""

from __future__ import annotations

import json
import logging
import os
import pickle
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from bootstrap.run_state import (
    CHECKPOINT,
    CHECKPOINTS,
    CONVERTED,
    MAX_LISTED,
    PREVIOUS_RUNS,
    RunMismatch,
    changes_meaning,
    config_changes,
    describe_changes,
    model_shapes,
    shape_mismatch,
)
from hetnode.config import Config
from hetnode.data.tokenizer import BpeTokenizer, Tokenizer
from hetnode.errors import CheckpointError, SetupMismatch
from hetnode.files import atomic_write_text
from hetnode.model.shards import layer_digests
from hetnode.replica.checkpoint import (
    MANIFEST,
    MAX_MANIFEST_BYTES,
    MAX_TOKENIZER_BYTES,
    TOKENIZER_FILE,
    WEIGHTS,
    CheckpointManifest,
    folder_name,
    list_checkpoints,
    load_checkpoint,
    manifest_from_dict,
    prune_checkpoints,
    read_manifest,
    save_checkpoint,
)
from hetnode.replica.global_model import GlobalModel
from hetnode.service.http_server import FileResponse, Response, Route

log = logging.getLogger(__name__)

DAMAGED = ".damaged"  # suffix of a checkpoint folder passed over at start
MANIFEST_ROUTE = "/api/checkpoint/manifest.json"
WEIGHTS_ROUTE = "/api/checkpoint/model.safetensors"
TOKENIZER_ROUTE = "/api/checkpoint/tokenizer.json"
ROUND_HEADER = "X-Hetnode-Round"  # on both answers: a client checks that its two downloads agree
OPEN_ATTEMPTS = 3  # the newest folder may be replaced or pruned between listing it and opening it


class NothingToResume(SetupMismatch):
    """`--resume` on a data dir that holds no checkpoint; nothing was changed."""


@dataclass(frozen=True)
class Restored:
    """θ as a checkpoint holds it, checked against the config (`params` is emptied once taken)."""

    params: dict[str, torch.Tensor]
    manifest: CheckpointManifest
    folder: Path


def checkpoints_root(data_dir: Path) -> Path:
    return Path(data_dir) / CHECKPOINTS


def another_run(manifest: CheckpointManifest, config: Config, run: str) -> str | None:
    """Why a checkpoint is not θ of `run` under `config` (None: it is). Settings that do not change what
    θ means (timings, limits, the schedule) may differ, as between two starts of one run."""
    if manifest.run is not None and manifest.run != run:
        return f"it was written by run {manifest.run}, and the data dir holds run {run}"
    changes = config_changes(manifest.config, config)
    meaning = {key: change for key, change in changes.items() if changes_meaning(key, *change)}
    if meaning:
        keys = ", ".join(sorted(meaning)[:MAX_LISTED])
        return f"its config differs from --config in {keys} ({describe_changes(meaning)})"
    return None


def restore(data_dir: Path, config: Config, run: str, resume: bool = False) -> Restored | None:
    """θ from the newest usable checkpoint of `run` in `data_dir` (None: there is none, and `resume` is
    off). Raises NothingToResume (`resume` and no checkpoint), RunMismatch (another run's or config's
    checkpoint), or CheckpointError (every checkpoint damaged); each with nothing changed on disk."""
    root = checkpoints_root(data_dir)
    found = list_checkpoints(root)
    if not found:
        if resume:
            raise NothingToResume(
                f"--resume: data dir {data_dir} holds no checkpoint ({root} has no round-NNNNNN/ folder), so "
                f"there is nothing to resume. Nothing was changed. Give the --data-dir of the run to resume, "
                f"restore its checkpoints/ from a backup, or start without --resume to begin a run here"
            )
        return None
    expected = model_shapes(config)
    passed: list[tuple[Path, str]] = []
    for round_, folder in reversed(found):
        try:
            manifest = read_manifest(folder)
        except CheckpointError as exc:
            passed.append((folder, str(exc)))
            continue
        if (why := another_run(manifest, config, run)) is not None:
            raise RunMismatch(
                f"checkpoint {folder} is not θ of this run: {why}. Nothing was changed. Start with the "
                f"config that made it (its {MANIFEST} holds it), give another --data-dir, or add --new-run "
                f"to move this run's files into {Path(data_dir) / PREVIOUS_RUNS}/ and begin a new run here"
            )
        try:
            params, manifest = load_checkpoint(folder)
            problem = shape_mismatch({name: tuple(t.shape) for name, t in params.items()}, expected)
            if problem is not None:
                raise CheckpointError(f"{folder} holds another model than its config: {problem}")
            if manifest.round != round_:
                raise CheckpointError(f"{folder}/{MANIFEST} says round {manifest.round}")
        except CheckpointError as exc:
            passed.append((folder, str(exc)))
            continue
        for damaged, why in passed:
            aside = damaged.with_name(damaged.name + DAMAGED)
            log.warning("passing over damaged checkpoint %s (%s); renamed %s", damaged, why, aside.name)
            os.replace(damaged, _free(aside))
        if passed:
            log.warning("θ restored from the previous checkpoint, %s (round %d)", folder.name, round_)
        return Restored(params, manifest, folder)
    reasons = "; ".join(why for _, why in passed[:MAX_LISTED])
    raise CheckpointError(
        f"no checkpoint in {root} is usable ({reasons}). Nothing was changed. Restore a round-NNNNNN/ "
        f"folder from a backup into {root}, or add --new-run to move this run's files into "
        f"{Path(data_dir) / PREVIOUS_RUNS}/ and begin a new run here"
    )


def _free(path: Path) -> Path:
    """`path`, or `path.1`, `path.2`… when a folder of that name is there already."""
    n, free = 1, path
    while free.exists():
        free, n = path.with_name(f"{path.name}.{n}"), n + 1
    return free


def convert_legacy(data_dir: Path, config: Config, run: str) -> Path | None:
    """Turn an old `global.pt` into a checkpoint folder (once: the pickle is then `global.pt.converted`);
    the folder, or None when there was no such file. CheckpointError, with nothing changed, when the
    file is unreadable or not this config's model."""
    path = Path(data_dir) / CHECKPOINT
    if not path.exists():
        return None
    try:
        params, round_, seal_hash = _read_legacy(path, config)
    except CheckpointError as exc:
        raise CheckpointError(
            f"{exc}. Nothing was changed. Restore it from a backup, or move it out of {data_dir} to go on "
            f"from the seeded θ (the coordinator takes the rounds it missed from the replicas)"
        ) from None
    manifest = CheckpointManifest.of(config, round_, seal_hash, layer_digests(params), run)
    folder = save_checkpoint(checkpoints_root(data_dir) / folder_name(round_), params, manifest)
    load_checkpoint(folder)  # read back before the original goes: what the next start takes
    os.replace(path, Path(data_dir) / CONVERTED)
    log.warning(
        "converted %s (round %d) into %s; the original is now %s: delete it once this run goes on",
        path.name,
        round_,
        folder,
        CONVERTED,
    )
    return folder


def _read_legacy(path: Path, config: Config) -> tuple[dict[str, torch.Tensor], int, str | None]:
    """(params, round, seal hash) of an old checkpoint, each checked: the file is untrusted."""
    try:  # weights_only: tensors and plain containers, never code
        state = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except pickle.UnpicklingError:  # torch's message here advises loading it anyway: not ours to give
        raise CheckpointError(
            f"{path} is unreadable: it holds objects other than tensors, and loading those could run code"
        ) from None
    except Exception as exc:  # torch raises many kinds for a damaged or hostile file; all mean "unreadable"
        first = (str(exc).strip().splitlines() or [""])[0][:200]
        raise CheckpointError(f"{path} is unreadable ({type(exc).__name__}: {first})") from None
    params = state.get("params") if isinstance(state, dict) else None
    if not isinstance(params, dict) or not all(
        isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in params.items()
    ):
        raise CheckpointError(f"{path} is not a coordinator checkpoint (no params of named tensors)")
    round_ = state.get("params_round")
    if not isinstance(round_, int) or isinstance(round_, bool) or round_ < -1:
        raise CheckpointError(f"{path}: params_round must be an integer >= -1, got {round_!r}")
    for name, tensor in params.items():
        if tensor.dtype != torch.float32 or not torch.isfinite(tensor).all():
            raise CheckpointError(f"{path}: {name} is not finite float32")
    problem = shape_mismatch({name: tuple(t.shape) for name, t in params.items()}, model_shapes(config))
    if problem is not None:
        raise CheckpointError(f"{path} holds another model: {problem}")
    seal_hash = state.get("seal_hash")  # None: from before seals were chained (the history knows it)
    return params, round_, seal_hash if isinstance(seal_hash, str) else None


def store(root: Path, model: GlobalModel, config: Config, run: str | None) -> Path | None:
    """Write θ as `root/round-NNNNNN/` and keep the newest `outer.keep_checkpoints`; the folder, or None
    when the newest checkpoint holds this θ already (a stop right after a checkpoint round)."""
    return store_params(root, model.params, model.params_round, model.seal_hash, model.digests(), config, run)


def store_params(
    root: Path,
    params: dict[str, torch.Tensor],
    round_: int,
    seal_hash: str | None,
    digests: dict[str, str],
    config: Config,
    run: str | None,
) -> Path | None:
    """`store` for θ held outside a `GlobalModel` (the bookkeeping worker's snapshot of a round):
    `digests` must be those of `params`, as the caller checked."""
    manifest = CheckpointManifest.of(config, round_, seal_hash, digests, run)
    found = list_checkpoints(root)
    if found and _describes(found[-1][1]) == _key(manifest):
        return None
    if found and found[-1][0] > round_:
        log.info("round %d: the checkpoint of round %d is newer; not writing this one", round_, found[-1][0])
        return None
    folder = save_checkpoint(root / folder_name(round_), params, manifest)
    for gone in prune_checkpoints(root, config.outer.keep_checkpoints):
        log.debug("removed checkpoint %s (keeping the newest %d)", gone.name, config.outer.keep_checkpoints)
    return folder


def keep_tokenizer(root: Path, tokenizer: Tokenizer) -> Path | None:
    """Keep a BPE run's tokenizer as `root/tokenizer.json` (written atomically, only when it changed); the
    path, or None for the byte tokenizer, which has no file (a stale one is removed)."""
    path = Path(root) / TOKENIZER_FILE
    if not isinstance(tokenizer, BpeTokenizer):
        path.unlink(missing_ok=True)
        return None
    # the very bytes it was loaded from, where it came from a file: a pinned run's peers check them by
    # sha256, and another `tokenizers` version could serialise the same tokenizer differently
    source = tokenizer.path
    text = source.read_bytes().decode() if source is not None and source.is_file() else tokenizer.to_json()
    if len(text.encode()) > MAX_TOKENIZER_BYTES:  # no client would take it
        raise CheckpointError(f"tokenizer {tokenizer.name} is over {MAX_TOKENIZER_BYTES >> 20} MiB of JSON")
    if path.is_file() and path.read_text(encoding="utf-8") == text:
        return path
    atomic_write_text(path, text)
    return path


def _key(manifest: CheckpointManifest) -> tuple[Any, ...]:
    return manifest.round, manifest.seal_hash, manifest.layer_digests, manifest.config_hash, manifest.run


def _describes(folder: Path) -> tuple[Any, ...] | None:
    try:
        return _key(read_manifest(folder))
    except CheckpointError:
        return None  # damaged: rewritten if it is this round's


class CheckpointRoutes:
    """`GET /api/checkpoint/manifest.json` and `/api/checkpoint/model.safetensors`: the newest checkpoint
    on disk, for `hetnode export --from` and `hetnode sample --from`. Each answer comes from one folder,
    opened once; both carry `X-Hetnode-Round`, so a client whose two downloads straddle a new checkpoint
    sees it (and `load_checkpoint` refuses such a pair: the digests differ). `/api/checkpoint/tokenizer.json`:
    a BPE run's tokenizer (one per run, so no round)."""

    def __init__(self, root: Path) -> None:
        self.root = Path(root)

    def routes(self) -> dict[str, Route]:
        return {MANIFEST_ROUTE: self.manifest, WEIGHTS_ROUTE: self.weights, TOKENIZER_ROUTE: self.tokenizer}

    def manifest(self) -> Response:
        for _ in range(OPEN_ATTEMPTS):
            found = list_checkpoints(self.root)
            if not found:
                return _no_checkpoint()
            round_, folder = found[-1]
            try:
                with open(folder / MANIFEST, "rb") as f:
                    raw = f.read(MAX_MANIFEST_BYTES + 1)
            except FileNotFoundError:
                continue  # replaced or pruned since the listing: look again
            try:
                manifest_from_dict(json.loads(raw), str(folder / MANIFEST))
            except (ValueError, CheckpointError) as exc:
                return _json_error(500, f"the newest checkpoint's manifest is damaged ({exc})")
            return Response(raw, "application/json", headers=((ROUND_HEADER, str(round_)),))
        return _json_error(503, "checkpoints are being rewritten; retry")

    def weights(self) -> Response | FileResponse:
        for _ in range(OPEN_ATTEMPTS):
            found = list_checkpoints(self.root)
            if not found:
                return _no_checkpoint()
            round_, folder = found[-1]
            try:
                file = open(folder / WEIGHTS, "rb")  # noqa: SIM115 - the server streams and closes it
            except FileNotFoundError:
                continue
            headers = (
                (ROUND_HEADER, str(round_)),
                ("Content-Disposition", f'attachment; filename="{folder.name}.safetensors"'),
            )
            return FileResponse(file, os.fstat(file.fileno()).st_size, headers=headers)
        return _json_error(503, "checkpoints are being rewritten; retry")

    def tokenizer(self) -> Response | FileResponse:
        """A file answer: it takes a download slot like the weights, and no memory per client."""
        try:
            file = open(self.root / TOKENIZER_FILE, "rb")  # noqa: SIM115 - the server streams and closes it
        except FileNotFoundError:
            return _json_error(
                404,
                "no tokenizer here: the run uses the byte tokenizer, or the coordinator is still building it",
            )
        return FileResponse(file, os.fstat(file.fileno()).st_size, "application/json")


def _no_checkpoint() -> Response:
    return _json_error(404, "no checkpoint yet: the coordinator writes one every K rounds and when it stops")


def _json_error(status: int, message: str) -> Response:
    return Response(json.dumps({"error": message}).encode() + b"\n", "application/json", status)
