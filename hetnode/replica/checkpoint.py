"""θ on disk: a folder per checkpoint holding `model.safetensors` (the parameters by their global names,
float32) and `manifest.json` (the round, the seal it follows, the layer digests, the config and its hash).

safetensors, not pickle: a checkpoint is something people pass around (`hetnode export`, `hetnode sample`,
a coordinator's HTTP API), and loading one must never run code. The manifest is small JSON so that a
reader (or a person) can tell which run and round a checkpoint holds without reading the tensors. A BPE
run's coordinator keeps the run's tokenizer (`tokenizers` JSON) beside its round folders, as `tokenizer.json`.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file, save_file

from hetnode.config import Config
from hetnode.errors import CheckpointError
from hetnode.model.shards import layer_digests

FORMAT = "hetnode-checkpoint/1"
WEIGHTS = "model.safetensors"
MANIFEST = "manifest.json"
MAX_MANIFEST_BYTES = 4 << 20  # digests and a config: kilobytes; anything near this is not a manifest
TOKENIZER_FILE = "tokenizer.json"  # a BPE run's tokenizer, beside the round folders (the coordinator's)
MAX_TOKENIZER_BYTES = 16 << 20  # `tokenizers` JSON of a 65,536-id BPE is a few MB
_FOLDER = re.compile(r"^round-(\d{6,}|init)$")  # "init": θ before round 0 (round -1)
_LEFTOVER = re.compile(r"^round-(\d{6,}|init)\.(tmp|old)$")  # a save that a crash interrupted


def config_hash(config: Config | dict[str, Any]) -> str:
    """sha256 of the config's canonical JSON: equal hashes, equal configs."""
    raw = config.to_dict() if isinstance(config, Config) else config
    return hashlib.sha256(json.dumps(raw, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


@dataclass(frozen=True)
class CheckpointManifest:
    round: int  # θ after this round (-1: the seeded initialisation)
    seal_hash: str | None  # the seal of that round, so a restarted sealer chains its next seal to it
    layer_digests: dict[str, str]
    config: dict[str, Any]  # Config.to_dict() of the run
    config_hash: str
    run: str | None = None  # the run id, when a coordinator wrote it
    format: str = FORMAT
    extra: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def of(
        cls,
        config: Config,
        round_: int,
        seal_hash: str | None,
        layer_digests: dict[str, str],
        run: str | None = None,
    ) -> CheckpointManifest:
        return cls(round_, seal_hash, dict(layer_digests), config.to_dict(), config_hash(config), run)


def folder_name(round_: int) -> str:
    return f"round-{max(round_, 0):06d}" if round_ >= 0 else "round-init"


def save_checkpoint(folder: Path, params: dict[str, torch.Tensor], manifest: CheckpointManifest) -> Path:
    """Write `folder` (created; replaced whole if it exists) atomically: a reader sees the old checkpoint
    or the new one, never half of one."""
    folder = Path(folder)
    tmp, old = folder.with_name(folder.name + ".tmp"), folder.with_name(folder.name + ".old")
    if old.exists() and folder.exists():  # left by a crash after the swap below: the new one is whole
        shutil.rmtree(old)
    tmp.mkdir(parents=True, exist_ok=True)
    tensors = {name: t.detach().to("cpu", torch.float32).contiguous() for name, t in params.items()}
    save_file(tensors, str(tmp / WEIGHTS), metadata={"format": FORMAT, "round": str(manifest.round)})
    (tmp / MANIFEST).write_text(json.dumps(asdict(manifest), indent=1, sort_keys=True) + "\n")
    for part in (WEIGHTS, MANIFEST):
        with open(tmp / part, "rb") as f:
            os.fsync(f.fileno())
    if folder.exists():
        folder.replace(old)
        tmp.replace(folder)
        shutil.rmtree(old)  # a reader that opened a file in it keeps reading it (POSIX)
    else:
        tmp.replace(folder)
    _sync_folder(folder.parent)  # the rename survives a power cut
    return folder


def _sync_folder(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def read_manifest(folder: Path) -> CheckpointManifest:
    path = Path(folder) / MANIFEST
    try:
        if path.stat().st_size > MAX_MANIFEST_BYTES:
            raise CheckpointError(f"{path} is {path.stat().st_size} bytes, more than a manifest can be")
        raw = json.loads(path.read_text())
    except FileNotFoundError:
        raise CheckpointError(f"{folder} is not a hetnode checkpoint: it has no {MANIFEST}") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CheckpointError(f"{path} is unreadable ({exc})") from None
    return manifest_from_dict(raw, str(path))


def manifest_from_dict(raw: Any, where: str) -> CheckpointManifest:
    """A manifest from untrusted JSON (a file, or a coordinator's reply), every field checked."""
    if not isinstance(raw, dict) or raw.get("format") != FORMAT:
        found = raw.get("format") if isinstance(raw, dict) else type(raw).__name__
        raise CheckpointError(f"{where} is not a {FORMAT} manifest (format: {found!r})")
    round_, seal, digests, config = (
        raw.get("round"),
        raw.get("seal_hash"),
        raw.get("layer_digests"),
        raw.get("config"),
    )
    if not isinstance(round_, int) or isinstance(round_, bool) or round_ < -1:
        raise CheckpointError(f"{where}: round must be an integer >= -1, got {round_!r}")
    if seal is not None and not isinstance(seal, str):
        raise CheckpointError(f"{where}: seal_hash must be a string or null")
    if not isinstance(digests, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in digests.items()
    ):
        raise CheckpointError(f"{where}: layer_digests must map layer names to strings")
    if not isinstance(config, dict) or not isinstance(raw.get("config_hash"), str):
        raise CheckpointError(f"{where}: config and config_hash are required")
    if config_hash(config) != raw["config_hash"]:
        raise CheckpointError(f"{where}: config_hash does not match the config it names")
    run, extra = raw.get("run"), raw.get("extra", {})
    if run is not None and not isinstance(run, str):
        raise CheckpointError(f"{where}: run must be a string or null")
    if not isinstance(extra, dict):
        raise CheckpointError(f"{where}: extra must be an object")
    return CheckpointManifest(round_, seal, digests, config, raw["config_hash"], run, FORMAT, extra)


def load_checkpoint(folder: Path) -> tuple[dict[str, torch.Tensor], CheckpointManifest]:
    """The parameters (float32, CPU) and manifest of the checkpoint in `folder`; CheckpointError when it
    is missing, damaged, its tensors are not finite, or they do not hash to the manifest's layer digests
    (a torn copy, or a manifest and weights from two checkpoints)."""
    folder = Path(folder)
    manifest = read_manifest(folder)
    try:
        params = load_file(str(folder / WEIGHTS), device="cpu")
    except FileNotFoundError:
        raise CheckpointError(f"{folder} has a manifest but no {WEIGHTS}") from None
    except (SafetensorError, OSError, ValueError) as exc:
        raise CheckpointError(f"{folder / WEIGHTS} is unreadable ({exc})") from None
    for name, tensor in params.items():
        if tensor.dtype != torch.float32:
            raise CheckpointError(f"{folder / WEIGHTS}: {name} is {tensor.dtype}, not float32")
        if not torch.isfinite(tensor).all():
            raise CheckpointError(f"{folder / WEIGHTS}: {name} holds values that are not finite")
    if layer_digests(params) != manifest.layer_digests:
        raise CheckpointError(f"{folder / WEIGHTS} does not match the layer digests of its {MANIFEST}")
    return params, manifest


def weights_shapes(path: Path) -> dict[str, tuple[int, ...]]:
    """{name: shape} from a `model.safetensors` header alone (no tensor is read)."""
    try:
        with safe_open(str(path), framework="pt") as weights:
            return {name: tuple(weights.get_slice(name).get_shape()) for name in weights.keys()}  # noqa: SIM118
    except FileNotFoundError:
        raise CheckpointError(f"{path} is missing") from None
    except (SafetensorError, OSError, ValueError) as exc:
        raise CheckpointError(f"{path} is unreadable ({exc})") from None


def list_checkpoints(root: Path) -> list[tuple[int, Path]]:
    """(round, folder) of every complete checkpoint under `root`, oldest first."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = []
    for child in root.iterdir():
        match = _FOLDER.match(child.name)
        if match and (child / WEIGHTS).is_file() and (child / MANIFEST).is_file():
            found.append((-1 if match.group(1) == "init" else int(match.group(1)), child))
    return sorted(found)


def latest_checkpoint(root: Path) -> Path | None:
    """The folder of the newest complete checkpoint under `root`, or None."""
    found = list_checkpoints(root)
    return found[-1][1] if found else None


def prune_checkpoints(root: Path, keep: int) -> list[Path]:
    """Delete all but the newest `keep` checkpoints under `root`, and what crashed saves left behind (a
    `.tmp`, or an `.old` whose replacement is whole); the folders deleted. Only the writer calls this."""
    if keep < 1:
        raise ValueError(f"keep must be at least 1, got {keep}")
    found = list_checkpoints(root)
    doomed = [folder for _, folder in found[:-keep]]
    if Path(root).is_dir():
        for child in Path(root).iterdir():
            match = _LEFTOVER.match(child.name)
            if match and (match.group(2) == "tmp" or child.with_suffix("").is_dir()):
                doomed.append(child)
    for folder in doomed:
        shutil.rmtree(folder, ignore_errors=True)
    return doomed
