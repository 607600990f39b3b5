"""Which checkpoint folder a user's local `--from PATH` names, for `hetnode export` and `hetnode sample`.

Accepted, each the way a user has it at hand:

- a checkpoint folder (`manifest.json` + `model.safetensors`), or a file in one;
- a folder of `round-NNNNNN/` checkpoints (a coordinator's `checkpoints/`): the newest;
- a folder with such a `checkpoints/` inside: a `hetnode train` run's folder (`runs/NAME`) or a
  coordinator's `--data-dir`: its newest.

What is found is said (INFO); what is refused names what was there and what to pass instead, as a
ConfigError (exit 2: asking again gets the same). Only a `checkpoints/` folder with no checkpoint yet is a
CheckpointError (exit 1): a coordinator writes its first after K rounds, a training run at its first
checkpoint step. An old `hetnode train` folder (`checkpoint.pt`, a pickle without the run's config) is
refused with the command that converts it; it is not read here beyond the step it names.
"""

from __future__ import annotations

import logging
from pathlib import Path

from hetnode.errors import CheckpointError, ConfigError
from hetnode.replica.checkpoint import MANIFEST, WEIGHTS, list_checkpoints

log = logging.getLogger(__name__)

# the names of a run folder's layout (`hetnode/training/run_checkpoints.py`, which export may not import;
# tests/export/test_locate.py holds them equal) and of a coordinator's data dir (`bootstrap/`)
CHECKPOINTS = "checkpoints"
LEGACY = "checkpoint.pt"
CONVERTED = "checkpoint.pt.converted"
STATE_PREFIX = "trainer-state-"
ACCEPTED = (
    "a checkpoint folder (manifest.json + model.safetensors), a `hetnode train` run folder (runs/NAME), "
    "a coordinator's --data-dir, or a coordinator URL http://host:port"
)
LISTED = 6  # entries named when a folder is not what we look for


def checkpoint_folder(source: str) -> Path:
    """The checkpoint folder that `source` (a local path) names; see the module docstring."""
    path = Path(source).expanduser()
    if not path.exists():
        hint = _hint_beside(path)
        raise ConfigError("--from", "source", f"{path}: no such file or folder; {hint or f'pass {ACCEPTED}'}")
    if path.is_file():
        return _from_file(path)
    if (path / MANIFEST).is_file():
        return path
    found = list_checkpoints(path)
    if found:
        return _newest(found, f"{path} holds {_count(found)}")
    inner = path / CHECKPOINTS
    found = list_checkpoints(inner)
    if found:
        return _newest(found, f"{path} is {_kind(path)}; {inner} holds {_count(found)}")
    if (path / LEGACY).is_file():
        raise _legacy(path / LEGACY)
    if inner.is_dir():
        raise CheckpointError(
            f"{path} is {_kind(path)} but {inner} holds no checkpoint yet ({_listing(inner)}): a coordinator "
            f"writes one every outer.checkpoint_every_rounds rounds and when it stops, `hetnode train` every "
            f"train.checkpoint_every steps and at its end"
        )
    raise ConfigError(
        "--from",
        "source",
        f"{path} is not a checkpoint: it holds no {MANIFEST}, no round-NNNNNN/ folder and no {CHECKPOINTS}/ "
        f"folder ({_listing(path)}); pass {ACCEPTED}",
    )


def _from_file(path: Path) -> Path:
    folder = path.parent
    if path.name in (MANIFEST, WEIGHTS) and (folder / MANIFEST).is_file():
        log.info("%s is a file of the checkpoint folder %s: taking that folder", path, folder)
        return folder
    if path.name == LEGACY:
        raise _legacy(path)
    if path.name == CONVERTED or path.name.startswith(STATE_PREFIX):
        what = "an old checkpoint, converted already" if path.name == CONVERTED else "a trainer state"
        raise ConfigError(
            "--from",
            "source",
            f"{path} is {what} of a `hetnode train` run, not its checkpoint: pass --from {folder}",
        )
    aside = " (a tokenizer goes to --tokenizer)" if path.suffix == ".json" else ""
    hint = _hint_beside(path) or f"pass {ACCEPTED}"
    raise ConfigError("--from", "source", f"{path} is a file, not a checkpoint folder{aside}; {hint}")


def _newest(found: list[tuple[int, Path]], what: str) -> Path:
    folder = found[-1][1]
    log.info("%s: taking the newest, %s", what, folder)
    return folder


def _count(found: list[tuple[int, Path]]) -> str:
    return "1 checkpoint" if len(found) == 1 else f"{len(found)} checkpoints"


def _kind(path: Path) -> str:
    if any(path.glob(f"{STATE_PREFIX}*")) or (path / "metrics.jsonl").is_file():
        return "a `hetnode train` run folder"
    return "a data dir"


def _listing(path: Path) -> str:
    try:
        names = sorted(child.name + ("/" if child.is_dir() else "") for child in path.iterdir())
    except OSError as exc:
        return f"unreadable: {exc.strerror}"
    if not names:
        return "it is empty"
    more = f" and {len(names) - LISTED} more" if len(names) > LISTED else ""
    return "found: " + ", ".join(names[:LISTED]) + more


def _hint_beside(path: Path) -> str | None:
    """For a path that is not there: the run folder or checkpoint folder it was probably meant to name."""
    parent = path.parent
    if parent == path or not parent.is_dir():
        return None
    if (parent / MANIFEST).is_file() or list_checkpoints(parent) or list_checkpoints(parent / CHECKPOINTS):
        return f"{parent} holds a checkpoint: pass --from {parent}"
    return None


def _legacy(path: Path) -> ConfigError:
    folder = path.parent
    step = _legacy_step(path)
    steps = f" --max-steps {step}" if step is not None else ""
    config = Path("configs") / f"{folder.name}.toml"
    config_flag = str(config) if config.is_file() else "CONFIG"
    return ConfigError(
        "--from",
        "source",
        f"{path} is an old `hetnode train` checkpoint (a pickle without the run's config), which export and "
        f"sample do not read: convert it once with `hetnode train --config {config_flag} --out {folder} "
        f"--resume{steps}` (--config: the config it was trained with), then pass --from {folder}",
    )


def _legacy_step(path: Path) -> int | None:
    """The step an old checkpoint names, read with `weights_only` (no code runs); None if unreadable."""
    import torch  # only on this refusal: a pickle of tensors, megabytes

    try:
        state = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except Exception:  # noqa: BLE001 (a damaged or hostile file: the command goes without --max-steps)
        return None
    step = state.get("step") if isinstance(state, dict) else None
    return step if isinstance(step, int) and not isinstance(step, bool) and step >= 0 else None
