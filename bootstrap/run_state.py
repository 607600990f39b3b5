"""The run a coordinator's data dir holds, checked against `--config` before anything there is written.

`coordinator.json` names the run (its id, when it began, the config it was made with); `checkpoints/`
(`bootstrap/checkpoint_store.py`; `global.pt` before), `rounds.jsonl` and `ledger.sqlite` are that run's θ,
history and credit. A config that would give them another meaning (another run name, seed, model,
vocabulary or input embedding) is refused with nothing changed on disk, so the next start with the right
config comes back as the same run. Other settings (timings, limits, the schedule) may change between starts
of one run: the coordinator logs what changed.

`--new-run` starts a new run in the same data dir on purpose: the old run's files move into
`DATA_DIR/previous-runs/<UTC time>-<run id>/` (renamed, never deleted). The identity key, the listen port
and `admissions.json` stay: they belong to the coordinator (its peer id and address, the join tokens it
signed), not to one run.
"""

from __future__ import annotations

import json
import logging
import pickle
import re
import secrets
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from bootstrap.ledger import SCHEMA_VERSION
from hetnode.config import Config
from hetnode.errors import CheckpointError, HetnodeError, SetupMismatch
from hetnode.model.decoder import parameter_shapes
from hetnode.replica.checkpoint import WEIGHTS, list_checkpoints, weights_shapes
from hetnode.service.datadir import DataDir

log = logging.getLogger(__name__)

STATE_FILE = "coordinator.json"
CHECKPOINT = "global.pt"  # θ as versions before checkpoints/ wrote it (a pickle), converted on start
CONVERTED = "global.pt.converted"  # that file once converted: kept for the operator to delete
CHECKPOINTS = "checkpoints"  # round-NNNNNN/ folders (hetnode/replica/checkpoint.py)
HISTORY = "rounds.jsonl"
LEDGER_FILE = "ledger.sqlite"
NEIGHBOURS_FILE = "neighbours.json"
PREVIOUS_RUNS = "previous-runs"
# A run's own files, in the order `--new-run` moves them: the state first, so that a crash halfway leaves
# a θ without a run id (which a start refuses), never a run id with half of its files.
RUN_FILES = (
    STATE_FILE,
    CHECKPOINTS,
    CHECKPOINT,
    CONVERTED,
    HISTORY,
    LEDGER_FILE,
    f"{LEDGER_FILE}-wal",
    f"{LEDGER_FILE}-shm",
    f"{LEDGER_FILE}-journal",
    NEIGHBOURS_FILE,  # the old run's peers: a new run starts its own swarm
)
# What θ, the history and the ledger mean: a change here makes them another run's. `run.*` and `model.*`
# whole, and the vocabulary; `pipeline.compression` only between "none" and a subspace mode.
IDENTITY_SECTIONS = ("run", "model")
# what the run trains on: the documents (which column, how many, which split) and their tokens
IDENTITY_KEYS = (
    "data.source",
    "data.tokenizer",
    "data.bpe_vocab_size",
    "data.text_column",
    "data.max_documents",
    "data.hf_split",
    "data.hf_subset",
    "data.tokenizer_sha256",
)
LISTEN_KEYS = ("listen_requested", "listen_port")  # the coordinator's address outlives its runs
MAX_LISTED = 6  # differences named in a refusal


class RunMismatch(SetupMismatch):
    """The data dir holds a run that `--config` does not continue; nothing was changed."""


@dataclass(frozen=True)
class StoredRun:
    """A data dir's run as `check_stored_run` accepted it: the state to go on with ({} for a data dir
    without a run) and the settings that changed since the last start ({key: (was, now)})."""

    state: dict[str, Any]
    changed: dict[str, tuple[Any, Any]]


def flat_config(config: dict[str, Any]) -> dict[str, Any]:
    """{"section.key": value} of a config's dict (`Config.to_dict()`)."""
    return {
        f"{section}.{key}": value
        for section, fields in config.items()
        if isinstance(fields, dict)
        for key, value in fields.items()
    }


def changes_meaning(key: str, was: Any, now: Any) -> bool:
    """Whether a setting going from `was` to `now` makes θ, the history and the ledger another run's."""
    if key == "pipeline.compression":  # any subspace mode adds T_fix to the architecture (global_model.py)
        return (was == "none") != (now == "none")
    return key.split(".", 1)[0] in IDENTITY_SECTIONS or key in IDENTITY_KEYS


def config_changes(stored: dict[str, Any], config: Config) -> dict[str, tuple[Any, Any]]:
    """{key: (stored, now)} for every setting that differs. A key only one side has (a setting added or
    removed by an upgrade of hetnode) is no difference: there is nothing to compare it with."""
    was = flat_config(stored)
    now = flat_config(json.loads(json.dumps(config.to_dict())))  # as it reads back from the state file
    return {key: (was[key], now[key]) for key in sorted(now) if key in was and was[key] != now[key]}


def model_shapes(config: Config) -> dict[str, tuple[int, ...]]:
    """Every parameter of the whole model `config` builds, and its shape."""
    return parameter_shapes(config.model)


def shape_mismatch(found: dict[str, tuple[int, ...]], expected: dict[str, tuple[int, ...]]) -> str | None:
    """Why parameters of shapes `found` are not the model of `expected` (None: they are)."""
    missing, extra = sorted(set(expected) - set(found)), sorted(set(found) - set(expected))
    if missing or extra:
        example = f"no {missing[0]}" if missing else f"an extra {extra[0]}"
        return f"{len(found)} tensors where the config's model has {len(expected)} ({example})"
    for name in sorted(expected):
        if found[name] != expected[name]:
            shown = "x".join(map(str, found[name])), "x".join(map(str, expected[name]))
            return f"{name} is {shown[0]} there and {shown[1]} in the config's model"
    return None


def checkpoint_shapes(path: Path) -> dict[str, tuple[int, ...]]:
    """The parameter shapes in a coordinator checkpoint (a `round-NNNNNN/` folder, its `model.safetensors`,
    or an old `global.pt`), read without loading the tensors (the safetensors header; mmap for a pickle)."""
    if path.is_dir():
        path = path / WEIGHTS
    if path.suffix == ".safetensors":
        return weights_shapes(path)
    try:
        state = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
        return {name: tuple(tensor.shape) for name, tensor in state["params"].items()}
    except pickle.UnpicklingError:  # torch's message advises loading it anyway: not ours to give
        raise CheckpointError(f"{path} is unreadable: it holds objects other than tensors") from None
    except Exception as exc:  # torch raises many kinds for a damaged file; all mean "unreadable"
        first = (str(exc).strip().splitlines() or [""])[0][:200]
        raise CheckpointError(f"{path} is unreadable ({type(exc).__name__}: {first})") from None


def ledger_problem(path: Path) -> tuple[str, str] | None:
    """(why, the fix) when this hetnode cannot open the ledger at `path` (None: it can, or there is none),
    read from the SQLite header so that checking writes nothing (no journal, no -shm file)."""
    if not path.exists():
        return None
    with open(path, "rb") as ledger:
        header = ledger.read(100)
    if not header:
        return None  # SQLite makes an empty file a database
    if len(header) < 100 or not header.startswith(b"SQLite format 3\x00"):
        return f"{path} is not a SQLite database", "restore it from a backup"
    version = int.from_bytes(header[60:64], "big")  # PRAGMA user_version
    if version > SCHEMA_VERSION:
        why = f"{path} has schema version {version}, newer than this hetnode's {SCHEMA_VERSION}"
        return why, "upgrade hetnode"
    return None


def check_stored_run(data_dir: DataDir, config: Config, config_path: Path) -> StoredRun:
    """The run in `data_dir` if `config` may go on with it, having read but not written a thing; raise
    `RunMismatch` (what the data dir holds, and the two ways forward) when it may not."""
    path = data_dir.path
    state = data_dir.read_json(STATE_FILE)
    present = [name for name in (CHECKPOINT, HISTORY, LEDGER_FILE) if (path / name).exists()]
    if list_checkpoints(path / CHECKPOINTS):
        present.insert(0, CHECKPOINTS)
    if not state and not present:
        return StoredRun({}, {})
    if not state:
        raise RunMismatch(
            f"data dir {path} holds a run's files ({', '.join(present)}) but no {STATE_FILE}, so not "
            f"which run they belong to. Nothing was changed. Restore {path / STATE_FILE} from a backup to "
            f"go on with that run, or {_ways_forward(path)}"
        )
    if not isinstance(state.get("run"), str) or not state["run"]:
        raise RunMismatch(
            f"{path / STATE_FILE} names no run id. Nothing was changed. Restore it from a backup to go on "
            f"with that run, or {_ways_forward(path)}"
        )
    stored = state.get("config")
    changes = config_changes(stored, config) if isinstance(stored, dict) else {}
    # the run's name first, then its model: what a reader recognises a run by
    order = sorted(changes, key=lambda key: (key.split(".", 1)[0] not in ("run", "model"), key != "run.name"))
    identity = {key: changes[key] for key in order if changes_meaning(key, *changes[key])}
    reasons = [describe_changes({key: change}) for key, change in identity.items()]
    if not isinstance(stored, dict) and state.get("config_name") not in (None, config.run.name):
        reasons.append(f"run.name {state['config_name']!r} -> {config.run.name!r}")  # an older state file
    run = state["run"]
    if (ledger := ledger_problem(path / LEDGER_FILE)) is not None:
        why, fix = ledger
        raise RunMismatch(
            f"{why}. Nothing was changed. {fix.capitalize()} to go on with run {run}, or "
            f"{_ways_forward(path)}"
        )
    if (path / CHECKPOINT).exists():
        try:
            found = checkpoint_shapes(path / CHECKPOINT)
        except CheckpointError as exc:
            raise RunMismatch(
                f"{exc}. Nothing was changed. Restore it from a backup to go on with run {run}, or "
                f"{_ways_forward(path)}"
            ) from None
        if (problem := shape_mismatch(found, model_shapes(config))) is not None:
            reasons.append(f"{CHECKPOINT} holds another model: {problem}")
    if (newest := newest_shapes(path / CHECKPOINTS)) is not None:
        name, found = newest
        if (problem := shape_mismatch(found, model_shapes(config))) is not None:
            reasons.append(f"{CHECKPOINTS}/{name} holds another model: {problem}")
    if reasons:
        more = len(reasons) - MAX_LISTED
        shown = reasons[:MAX_LISTED] + ([f"and {more} more"] if more > 0 else [])
        raise RunMismatch(
            f"data dir {path} holds run {run} (config {state.get('config_name')!r}), which --config "
            f"{config_path} does not continue: {'; '.join(shown)}. Nothing was changed. To go on with run "
            f"{run}, start with its config; to start a new run, {_ways_forward(path)}"
        )
    return StoredRun(state, {key: change for key, change in changes.items() if key not in identity})


def newest_shapes(root: Path) -> tuple[str, dict[str, tuple[int, ...]]] | None:
    """(folder name, shapes) of the newest checkpoint under `root` whose header reads; a damaged one is
    skipped here, and warned about by the start that falls back past it (`checkpoint_store.restore`)."""
    for _, folder in reversed(list_checkpoints(root)):
        try:
            return folder.name, checkpoint_shapes(folder)
        except CheckpointError:
            continue
    return None


def _ways_forward(path: Path) -> str:
    return (
        f"give another --data-dir, or add --new-run to move this run's files into "
        f"{path / PREVIOUS_RUNS}/ and begin a new run here (same peer id and address)."
    )


def new_run_state(config: Config, carried: dict[str, Any] | None = None) -> dict[str, Any]:
    """A new run's `coordinator.json`; `carried`: an earlier run's state whose listen port it keeps."""
    state = {key: (carried or {})[key] for key in LISTEN_KEYS if key in (carried or {})}
    state.update(
        run=f"{config.run.name}-{secrets.token_hex(4)}",
        created=time.time(),
        config_name=config.run.name,
        config=config.to_dict(),
    )
    return state


def move_run_aside(data_dir: DataDir, state: dict[str, Any]) -> tuple[Path, list[str]] | None:
    """Move the run's files (`RUN_FILES`) into `previous-runs/<UTC time>-<run id>/`; the folder and the
    files moved, or None when there were none."""
    run = re.sub(r"[^A-Za-z0-9._-]", "_", str(state.get("run", "unknown")))[:80]
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    folder, n = f"{PREVIOUS_RUNS}/{stamp}-{run}", 1
    while (data_dir.path / folder).exists():  # two new runs within a second
        folder, n = f"{PREVIOUS_RUNS}/{stamp}-{run}-{n}", n + 1
    moved = data_dir.move_aside(RUN_FILES, folder)
    return (data_dir.path / folder, moved) if moved else None


def describe_changes(changes: dict[str, tuple[Any, Any]]) -> str:
    """`key 'was' -> 'now'`, comma-separated: how a refusal and the start-up log name changed settings."""
    return ", ".join(f"{key} {was!r} -> {now!r}" for key, (was, now) in changes.items())


def go_on_with_run(data_dir: DataDir, config: Config, config_path: Path) -> dict[str, Any]:
    """The state of the run in `data_dir`, checked to go on with `config` (a new run's for a data dir
    without one), for the caller to write once it is up; `RunMismatch` with nothing written otherwise."""
    stored = check_stored_run(data_dir, config, config_path)
    if not stored.state:
        return new_run_state(config)
    if stored.changed:
        log.warning(
            "run %s goes on with changed settings: %s (peers read the config when they join: restart them "
            "for the change to reach them)",
            stored.state.get("run"),
            describe_changes(stored.changed),
        )
    since = {"created": time.time()}  # a state file of an early version may lack it
    return since | stored.state | {"config_name": config.run.name, "config": config.to_dict()}


def begin_new_run(data_dir: DataDir, config: Config) -> dict[str, Any]:
    """`--new-run`: the old run's files moved aside (never deleted) and the new run's state written."""
    try:
        old = data_dir.read_json(STATE_FILE)
    except HetnodeError:  # a damaged state file moves aside with the rest
        old = {}
    aside = move_run_aside(data_dir, old)
    state = new_run_state(config, carried=old)
    data_dir.write_json(STATE_FILE, state)
    if aside is None:
        log.info("--new-run: the data dir held no run; starting run %s", state["run"])
    else:
        folder, moved = aside
        log.warning(
            "--new-run: run %s (%s) moved into %s; starting run %s",
            old.get("run", "of unknown id"),
            ", ".join(moved),
            folder,
            state["run"],
        )
    return state
