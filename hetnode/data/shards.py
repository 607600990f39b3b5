"""Token shards: a document source tokenised once into memory-mapped files, named by a fingerprint.

`<data_dir>/tokens/<fingerprint>/` holds `train-00000.bin …` and `eval-00000.bin …` (little-endian uint16
ids, each document followed by eos) and `manifest.json`: what made them (source, column, tokenizer, eval
fraction), their token counts and sha256 digests. The fingerprint hashes everything that changes the
streams, so a second build with the same inputs finds the folder and reads no source at all; a shard of the
wrong size or digest, or a manifest that does not match, is reported as `ShardsUnusable` and rebuilt. A build
writes into a temporary folder and renames it into place, so peers sharing a data dir never see half of one.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np

FORMAT = 1
DTYPE = "<u2"
SHARD_TOKENS = 1 << 27  # ids per file (256 MiB): large enough to be few, small enough to copy around
MANIFEST = "manifest.json"
SPLITS = ("train", "eval")


class ShardsUnusable(Exception):
    """A token folder that cannot be used as it is (missing, damaged, or made from other inputs)."""


@dataclass(frozen=True)
class Shards:
    manifest: dict[str, Any]
    train: list[np.ndarray]
    eval: list[np.ndarray]


def fingerprint(key: dict[str, Any]) -> str:
    """The folder name of the shards made from `key` (JSON: source identity, column, tokenizer, split)."""
    blob = json.dumps({"format": FORMAT, **key}, sort_keys=True, separators=(",", ":"))
    return hashlib.blake2b(blob.encode("utf-8"), digest_size=16).hexdigest()


class ShardWriter:
    """Appends one split's tokens to files of at most SHARD_TOKENS ids, hashing them as they are written."""

    def __init__(self, folder: Path, split: str) -> None:
        self.folder = folder
        self.split = split
        self.shards: list[dict[str, Any]] = []
        self.tokens = 0
        self.max_id = -1
        self._fh: BinaryIO | None = None
        self._hash = hashlib.sha256()
        self._count = 0

    def write(self, tokens: np.ndarray) -> None:
        data = np.ascontiguousarray(tokens, dtype=DTYPE)
        if data.size:
            self.max_id = max(self.max_id, int(data.max()))
        while data.size:
            if self._fh is None:
                self._fh = open(self.folder / self._name(), "wb")  # noqa: SIM115 (closed in _finish)
            part, data = data[: SHARD_TOKENS - self._count], data[SHARD_TOKENS - self._count :]
            raw = part.tobytes()
            self._fh.write(raw)
            self._hash.update(raw)
            self._count += part.size
            self.tokens += part.size
            if self._count >= SHARD_TOKENS:
                self._finish()

    def close(self) -> dict[str, Any]:
        """The manifest entry of this split."""
        if self._fh is not None:
            self._finish()
        return {"tokens": self.tokens, "max_id": self.max_id, "shards": self.shards}

    def _name(self) -> str:
        return f"{self.split}-{len(self.shards):05d}.bin"

    def _finish(self) -> None:
        assert self._fh is not None
        self._fh.close()
        self.shards.append({"file": self._name(), "tokens": self._count, "sha256": self._hash.hexdigest()})
        self._fh, self._hash, self._count = None, hashlib.sha256(), 0


def load_shards(folder: Path, key: dict[str, Any] | None) -> Shards:
    """Check a finished build against `key` (None: a prepared folder, whatever made it), every shard's size
    and sha256; memory-map its shards."""
    path = folder / MANIFEST
    if not path.is_file():
        raise ShardsUnusable("no manifest")
    try:
        manifest = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ShardsUnusable(f"unreadable manifest ({exc})") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise ShardsUnusable(f"manifest is not format {FORMAT}")
    if (key is not None and manifest.get("key") != key) or manifest.get("dtype") != DTYPE:
        raise ShardsUnusable("manifest was made from other inputs")
    try:
        streams = [_open_split(folder, manifest[split]) for split in SPLITS]
    except (KeyError, TypeError, ValueError) as exc:
        raise ShardsUnusable(f"malformed manifest ({type(exc).__name__}: {exc})") from None
    return Shards(manifest, *streams)


def _open_split(folder: Path, entry: dict[str, Any]) -> list[np.ndarray]:
    arrays = []
    for shard in entry["shards"]:
        name, tokens = str(shard["file"]), int(shard["tokens"])
        file = folder / name
        if Path(name).name != name or not file.is_file():
            raise ShardsUnusable(f"shard {name} is missing")
        size = file.stat().st_size
        if size != tokens * np.dtype(DTYPE).itemsize or tokens < 1:
            raise ShardsUnusable(f"shard {name} has {size} bytes, the manifest says {tokens} tokens")
        with file.open("rb") as fh:
            digest = hashlib.file_digest(fh, "sha256").hexdigest()
        if digest != shard["sha256"]:
            raise ShardsUnusable(f"shard {name} has sha256 {digest[:16]}…, not the manifest's")
        arrays.append(np.memmap(file, dtype=DTYPE, mode="r", shape=(tokens,)))
    if sum(a.size for a in arrays) != int(entry["tokens"]) or int(entry["max_id"]) < 0:
        raise ShardsUnusable("shard token counts do not add up to the manifest's")
    return arrays


def new_build(tokens_dir: Path) -> Path:
    tokens_dir.mkdir(parents=True, exist_ok=True)
    return Path(tempfile.mkdtemp(dir=tokens_dir, prefix=".build-"))


def install(build: Path, folder: Path, manifest: dict[str, Any]) -> None:
    """Write the manifest last, then swap the build in for whatever `folder` held (a damaged build)."""
    (build / MANIFEST).write_text(json.dumps(manifest, indent=1, sort_keys=True) + "\n", encoding="utf-8")
    if folder.exists():
        # moved aside first: a peer may still have the old shards mapped, which is fine once they are unlinked
        trash = folder.with_name(f".old-{folder.name}-{os.getpid()}-{time.time_ns()}")
        os.replace(folder, trash)
        shutil.rmtree(trash, ignore_errors=True)
    try:
        os.replace(build, folder)
    except OSError:  # another process on this data dir installed the same build first: use theirs
        shutil.rmtree(build, ignore_errors=True)


class Windows:
    """Rows of `width` tokens over a stream held in several shards, indexed like a 2-D array (copies)."""

    def __init__(self, shards: Sequence[np.ndarray], width: int, count: int) -> None:
        self._shards = list(shards)
        self._ends = np.cumsum([s.size for s in self._shards])
        self.width = width
        self.count = count
        self.shape = (count, width)

    def __len__(self) -> int:
        return self.count

    def __iter__(self) -> Iterator[np.ndarray]:
        return (self._row(i) for i in range(self.count))

    def __getitem__(self, key: int | slice | np.ndarray) -> np.ndarray:
        if isinstance(key, int | np.integer):
            return self._row(int(key))
        ids = range(*key.indices(self.count)) if isinstance(key, slice) else np.asarray(key).tolist()
        rows = [self._row(int(i)) for i in ids]
        return np.stack(rows) if rows else np.empty((0, self.width), dtype=DTYPE)

    def _row(self, i: int) -> np.ndarray:
        if not -self.count <= i < self.count:
            raise IndexError(f"window {i} out of range ({self.count})")
        start = (i % self.count) * self.width
        pieces, need = [], self.width
        s = int(np.searchsorted(self._ends, start, side="right"))
        while need:  # a window may straddle shard boundaries
            begin = start - (int(self._ends[s - 1]) if s else 0)
            piece = self._shards[s][begin : begin + need]
            pieces.append(piece)
            need -= piece.size
            start += piece.size
            s += 1
        return np.concatenate(pieces) if len(pieces) > 1 else np.array(pieces[0])


def windows(shards: Sequence[np.ndarray], width: int, count: int) -> np.ndarray | Windows:
    """`count` rows of `width` tokens from the start of the stream: a plain view when it is one array."""
    if len(shards) == 1:
        return shards[0][: count * width].reshape(count, width)
    return Windows(shards, width, count)
