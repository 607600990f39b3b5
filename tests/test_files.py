"""Atomic writes (`hetnode/files.py`): the new file whole, or the old one untouched and nothing beside it."""

from pathlib import Path

import pytest

from hetnode.files import atomic_write, atomic_write_bytes, atomic_write_text


def test_a_write_replaces_the_file_whole_and_leaves_nothing_beside_it(tmp_path: Path):
    path = tmp_path / "deep" / "state.json"
    atomic_write_text(path, "old")
    atomic_write_bytes(path, b"new", durable=False)
    assert path.read_bytes() == b"new" and sorted(p.name for p in path.parent.iterdir()) == ["state.json"]


def test_a_write_that_fails_half_way_keeps_the_old_file(tmp_path: Path):
    path = tmp_path / "state.pt"
    atomic_write_text(path, "old")

    def half(tmp: Path) -> None:
        tmp.write_text("half of the new one")
        raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        atomic_write(path, half)
    assert path.read_text() == "old" and [p.name for p in tmp_path.iterdir()] == ["state.pt"]
