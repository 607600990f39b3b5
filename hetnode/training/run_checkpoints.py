"""A `hetnode train` run's checkpoints: θ in the coordinator's format, the trainer's own state beside it.

A run folder (`runs/<name>/`) holds

    checkpoints/round-NNNNNN/                  θ after step NNNNNN: model.safetensors + manifest.json
    checkpoints/tokenizer.json                 a BPE run's tokenizer, as the coordinator keeps it
    trainer-state-NNNNNN.safetensors           what a resume needs besides θ: optimiser moments, step,
                                               tokens, the torch RNG (`state_file.py`: no pickle)
    metrics.jsonl, loss.png

The checkpoint folder is exactly a coordinator's (`hetnode/replica/checkpoint.py`), so `hetnode export`
and `hetnode sample` read a training run as they read a coordinator's data dir: `--from runs/<name>`.
A local run has no rounds; its manifest's round is the step count, and `extra` says so
(`{"trained_by": "hetnode train", "step": N, "tokens": T}`). Its config is the run's with compression
off: `hetnode train` adds no T_fix at the input, so an export must not add one either.

The trainer state is kept apart, not in the checkpoint folder: the folder is what people pass around,
the optimiser state is twice its size and of no use to anyone but a resume. Each state file is
named by its step and written before its checkpoint folder, and the older ones go only once the new
folder is whole: after a crash at any point, the newest checkpoint has its state beside it.

An old run's `checkpoint.pt` (a torch pickle) is converted once on `--resume`, as the coordinator does
for its `global.pt`: read with `weights_only=True` (no code runs), written in this format, read back,
and renamed `checkpoint.pt.converted`.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import shutil
from pathlib import Path
from typing import Any

import torch

from hetnode.config import Config, replace
from hetnode.data.tokenizer import BpeTokenizer, Tokenizer
from hetnode.errors import CheckpointError, ConfigError
from hetnode.files import atomic_write_text
from hetnode.model.decoder import parameter_shapes
from hetnode.model.shards import layer_digests
from hetnode.replica.checkpoint import (
    TOKENIZER_FILE,
    CheckpointManifest,
    folder_name,
    latest_checkpoint,
    list_checkpoints,
    load_checkpoint,
    save_checkpoint,
)
from hetnode.training.trainer import InnerTrainer, load_legacy_checkpoint
from hetnode.training.trainer import load_checkpoint as load_trainer_state
from hetnode.training.trainer import save_checkpoint as save_trainer_state

log = logging.getLogger(__name__)

CHECKPOINTS = "checkpoints"
LEGACY = "checkpoint.pt"  # what `hetnode train` wrote before this format
CONVERTED = "checkpoint.pt.converted"
STATE_PREFIX = "trainer-state-"
TRAINED_BY = "hetnode train"


def checkpoints_root(out_dir: Path) -> Path:
    return Path(out_dir) / CHECKPOINTS


def state_path(out_dir: Path, step: int) -> Path:
    return Path(out_dir) / f"{STATE_PREFIX}{step:06d}.safetensors"


def manifest_config(config: Config) -> Config:
    """The config θ of a local run belongs to: the run's, without the input T_fix it never trained with."""
    return (
        config if config.pipeline.compression == "none" else replace(config, "pipeline", compression="none")
    )


def save_run_checkpoint(out_dir: Path, config: Config, trainer: InnerTrainer) -> Path:
    """Write the trainer's θ as `checkpoints/round-<step>/` and its state beside it; then remove every
    other checkpoint of this folder (a previous run's too, as the old single file was overwritten)."""
    out_dir, step = Path(out_dir), trainer.step
    state = trainer.state_dict(weights=False)
    state["rng"] = torch.get_rng_state()
    save_trainer_state(state_path(out_dir, step), state)
    params = {n: p.detach().to("cpu", torch.float32) for n, p in trainer.model.named_parameters()}
    folder = save_checkpoint(
        checkpoints_root(out_dir) / folder_name(step), params, _manifest(config, params, step, trainer.tokens)
    )
    _remove_all_but(out_dir, folder, step)
    keep_tokenizer(out_dir, trainer.dataset.tokenizer)
    return folder


def keep_tokenizer(out_dir: Path, tokenizer: Tokenizer) -> None:
    """A BPE run's tokenizer as `checkpoints/tokenizer.json`, where the coordinator keeps its own: `sample`
    and `export` read it there instead of training the BPE again from the run's corpus."""
    path = checkpoints_root(out_dir) / TOKENIZER_FILE
    if not isinstance(tokenizer, BpeTokenizer):
        path.unlink(missing_ok=True)
        return
    text = tokenizer.to_json()
    if not (path.is_file() and path.read_text(encoding="utf-8") == text):
        atomic_write_text(path, text)


def _manifest(config: Config, params: dict[str, torch.Tensor], step: int, tokens: int) -> CheckpointManifest:
    manifest = CheckpointManifest.of(
        manifest_config(config), step, None, layer_digests(params), config.run.name
    )
    return dataclasses.replace(manifest, extra={"trained_by": TRAINED_BY, "step": step, "tokens": tokens})


def _remove_all_but(out_dir: Path, folder: Path, step: int) -> None:
    for _, other in list_checkpoints(checkpoints_root(out_dir)):
        if other != folder:
            shutil.rmtree(other, ignore_errors=True)
    keep = state_path(out_dir, step).name
    for other in out_dir.glob(f"{STATE_PREFIX}*.safetensors"):
        if other.name != keep:
            other.unlink(missing_ok=True)
    legacy = out_dir / LEGACY
    if legacy.exists():  # a fresh run in an old run's folder: the old format overwrote it here too
        legacy.unlink()
        log.warning("removed %s of a previous run (this run's checkpoint is %s)", legacy, folder)


def resume_run(out_dir: Path, config: Config, trainer: InnerTrainer) -> Path:
    """Load the run's newest checkpoint into `trainer` (θ, optimiser, step, tokens, RNG), converting an
    old `checkpoint.pt` first; the checkpoint folder. ConfigError when there is nothing to resume or it
    is another model; CheckpointError when the files are damaged."""
    out_dir = Path(out_dir)
    folder = latest_checkpoint(checkpoints_root(out_dir))
    if folder is None:
        folder = convert_legacy(out_dir, config)
    elif (out_dir / LEGACY).exists():
        log.warning("%s is ignored: %s holds this format's checkpoint", out_dir / LEGACY, folder)
    if folder is None:
        raise ConfigError(
            "--resume",
            "out",
            f"{out_dir} holds no checkpoint to resume from (no {CHECKPOINTS}/round-NNNNNN/ folder, no "
            f"{LEGACY}): pass the --out of the run to resume, or start without --resume",
        )
    params, manifest = load_checkpoint(folder)
    _check_model(manifest.config.get("model"), config, str(folder / "manifest.json"))
    step = manifest.extra.get("step", manifest.round)
    path = state_path(out_dir, step)
    if not path.exists():
        raise CheckpointError(
            f"{folder} has no trainer state beside it ({path.name} is missing), so training cannot go on "
            f"from it exactly; export and sample still read it (hetnode export --from {out_dir} --out DIR)"
        )
    state = load_trainer_state(path)
    if state.get("step") != step:
        raise CheckpointError(f"{path} holds step {state.get('step')!r}, not {step} as its name says")
    rng = state.pop("rng", None)
    trainer.load_state_dict({**state, "model": params})
    if isinstance(rng, torch.Tensor):
        torch.set_rng_state(rng)
    keep_tokenizer(out_dir, trainer.dataset.tokenizer)  # a converted run had none beside it
    return folder


def _check_model(written: Any, config: Config, where: str) -> None:
    wanted = dataclasses.asdict(config.model)
    if written != wanted:
        differ = sorted(k for k in wanted if not isinstance(written, dict) or written.get(k) != wanted[k])
        raise ConfigError(
            "--resume",
            "model",
            f"{where} holds another model than --config (differs in {', '.join(differ) or 'its keys'}): "
            f"pass the config it was trained with, or another --out to start a new run",
        )


def convert_legacy(out_dir: Path, config: Config) -> Path | None:
    """Turn an old `checkpoint.pt` into this format (once: the pickle is then `checkpoint.pt.converted`);
    the checkpoint folder, or None when there is no such file. Nothing is changed when it fails."""
    out_dir = Path(out_dir)
    path = out_dir / LEGACY
    if not path.exists():
        return None
    state = load_legacy_checkpoint(path)
    _check_model(state.get("model_config"), config, str(path))
    params, step, tokens = _legacy_parts(state, config, path)
    trainer_state = {k: state[k] for k in ("optimizer", "step", "tokens", "model_config")}
    save_trainer_state(state_path(out_dir, step), trainer_state)
    folder = save_checkpoint(
        checkpoints_root(out_dir) / folder_name(step), params, _manifest(config, params, step, tokens)
    )
    load_checkpoint(folder)  # read back before the original goes: what the resume takes
    load_trainer_state(state_path(out_dir, step))
    os.replace(path, out_dir / CONVERTED)
    log.warning(
        "converted %s (step %d) into %s and %s; the original is now %s: delete it once the run goes on",
        path,
        step,
        folder,
        state_path(out_dir, step).name,
        CONVERTED,
    )
    return folder


def legacy_step(path: Path) -> int | None:
    """The step an old `checkpoint.pt` was written at (None if it does not say): for the command that
    converts it."""
    step = load_legacy_checkpoint(path).get("step")
    return step if isinstance(step, int) and not isinstance(step, bool) else None


def _legacy_parts(
    state: dict[str, Any], config: Config, path: Path
) -> tuple[dict[str, torch.Tensor], int, int]:
    """(θ, step, tokens) of an old checkpoint, each checked: the file is a pickle from somewhere."""
    model, step, tokens = state.get("model"), state.get("step"), state.get("tokens")
    if not isinstance(model, dict) or not isinstance(state.get("optimizer"), dict):
        raise CheckpointError(f"{path} is not a `hetnode train` checkpoint (no model and optimizer state)")
    for name, value in (("step", step), ("tokens", tokens)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise CheckpointError(f"{path}: {name} must be an integer >= 0, got {value!r}")
    expected = parameter_shapes(config.model)
    if set(model) != set(expected):
        raise CheckpointError(f"{path} holds other tensors than the model of --config")
    for name, tensor in model.items():
        if not isinstance(tensor, torch.Tensor) or tuple(tensor.shape) != expected[name]:
            raise CheckpointError(f"{path}: {name} is not a tensor of shape {expected[name]}")
        if tensor.dtype != torch.float32 or not torch.isfinite(tensor).all():
            raise CheckpointError(f"{path}: {name} is not finite float32")
    return dict(model), step, tokens
