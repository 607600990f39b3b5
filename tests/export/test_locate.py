"""`--from PATH`: each layout a user has at hand is taken and said; anything else is refused (exit 2) naming
what was found and what to pass instead (issue 33, items 2, 5 and 8)."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from bootstrap import run_state
from hetnode.cli.main import main
from hetnode.errors import CheckpointError, ConfigError
from hetnode.export import locate
from hetnode.export.locate import checkpoint_folder
from hetnode.training import run_checkpoints

PROMPT = "The river"


@pytest.fixture
def coord_dir(small, write_checkpoint, tmp_path: Path) -> Path:
    """A coordinator's data dir: `checkpoints/round-000003/` and `round-000007/` (and what else it keeps)."""
    config = small("none", tied=False)
    write_checkpoint(config, round_=3)
    write_checkpoint(config, round_=7)
    (tmp_path / "rounds.jsonl").write_text("")
    return tmp_path


def test_the_names_agree_with_the_writers():
    assert locate.CHECKPOINTS == run_checkpoints.CHECKPOINTS == run_state.CHECKPOINTS
    assert (locate.LEGACY, locate.CONVERTED) == (run_checkpoints.LEGACY, run_checkpoints.CONVERTED)
    assert locate.STATE_PREFIX == run_checkpoints.STATE_PREFIX


def test_a_data_dir_a_checkpoints_folder_a_checkpoint_and_a_file_in_it(coord_dir: Path, caplog):
    caplog.set_level(logging.INFO)
    newest = coord_dir / "checkpoints" / "round-000007"
    assert checkpoint_folder(str(coord_dir)) == newest
    assert f"{coord_dir} is a data dir; {coord_dir / 'checkpoints'} holds 2 checkpoints" in caplog.text
    assert checkpoint_folder(str(coord_dir / "checkpoints")) == newest
    older = coord_dir / "checkpoints" / "round-000003"
    assert checkpoint_folder(str(older)) == older
    for name in ("manifest.json", "model.safetensors"):
        assert checkpoint_folder(str(older / name)) == older
    assert f"{older / 'model.safetensors'} is a file of the checkpoint folder {older}" in caplog.text


def test_sample_from_a_coordinators_data_dir(coord_dir: Path, capsys):
    assert main(["sample", "--from", str(coord_dir), "--prompt", PROMPT, "--tokens", "4"]) == 0
    assert capsys.readouterr().out.startswith(PROMPT)


@pytest.mark.parametrize(
    ("make", "words"),
    [
        (lambda t: t / "nonsense", ["nonsense: no such file or folder", "a `hetnode train` run folder"]),
        (lambda t: _touch(t / "notes.txt"), ["is a file, not a checkpoint folder"]),
        (lambda t: _touch(t / "bpe-4096.json"), ["a tokenizer goes to --tokenizer"]),
        (lambda t: _touch(t / "run" / "trainer-state-000002.safetensors"), ["a trainer state", "--from "]),
        (lambda t: _touch(t / "run" / "checkpoint.pt.converted"), ["converted already", "--from "]),
        (
            lambda t: _touch(t / "stuff" / "a.txt").parent,
            ["is not a checkpoint", "no checkpoints/ folder", "found: a.txt", "a coordinator's --data-dir"],
        ),
        (lambda t: _touch(t / "checkpoint.pt"), ["an old `hetnode train` checkpoint", "--resume"]),
    ],
    ids=["missing", "a file", "a tokenizer", "a trainer state", "converted", "another folder", "legacy"],
)
def test_what_is_no_checkpoint_is_a_usage_error_naming_what_to_pass(make, words, tmp_path: Path, capsys):
    path = make(tmp_path)
    with pytest.raises(ConfigError) as refused:
        checkpoint_folder(str(path))
    for word in words:
        assert word in str(refused.value)
    assert main(["sample", "--from", str(path), "--prompt", PROMPT]) == 2
    assert capsys.readouterr().err.startswith("hetnode: --from: ")


def test_a_file_beside_a_checkpoint_points_at_its_folder(coord_dir: Path):
    with pytest.raises(
        ConfigError, match=f"no such file or folder; {coord_dir} holds a checkpoint: pass --from {coord_dir}$"
    ):
        checkpoint_folder(str(coord_dir / "checkpoint.pt"))
    with pytest.raises(ConfigError, match=f"is a file, not a checkpoint folder; .* pass --from {coord_dir}$"):
        checkpoint_folder(str(coord_dir / "rounds.jsonl"))


def test_a_data_dir_with_no_checkpoint_yet_may_pass(tmp_path: Path, capsys):
    """A coordinator writes its first checkpoint after K rounds: asking again later helps, so exit 1."""
    (tmp_path / "checkpoints").mkdir()
    with pytest.raises(CheckpointError, match="holds no checkpoint yet"):
        checkpoint_folder(str(tmp_path))
    assert main(["export", "--from", str(tmp_path), "--out", str(tmp_path / "hf")]) == 1
    assert "checkpoint_every" in capsys.readouterr().err


def _touch(path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(b"x")
    return path
