"""`hf:` sources: anything `datasets.load_dataset` can stream, a hub name or a local file or folder.

`datasets` is an optional extra, imported only when an `hf:` source is read. Rows are streamed (never
downloaded or converted whole) and keyed `<split>#<row index>` in stream order. A local path is anything that
exists or starts with "/", "~" or "."; every other name goes to the hub (which needs a network; peers must
then also agree on the dataset's revision, which hetnode cannot check).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

from hetnode.config import DataConfig
from hetnode.data.documents import Document, SkippedRows, file_stats
from hetnode.errors import DataConfigError, DataError

HF_PIP = "pip install 'hetnode[hf]'"
# the packaged builder that reads a single local file, by suffix
BUILDERS = {
    ".parquet": "parquet",
    ".arrow": "arrow",
    ".json": "json",
    ".jsonl": "json",
    ".txt": "text",
    ".csv": "csv",
}


def hf_target(source: str) -> str | Path:
    """The local path or hub name an `hf:` source names."""
    rest = source.removeprefix("hf:")
    path = Path(rest).expanduser()
    if rest.startswith(("/", "~", ".")) or path.exists():
        return path
    return rest


def hf_identity(cfg: DataConfig) -> dict[str, Any]:
    """The cache key's view of the source: local files by size and mtime, a hub dataset by name only."""
    target = hf_target(cfg.source)
    ident: dict[str, Any] = {"split": cfg.hf_split, "subset": cfg.hf_subset}
    if isinstance(target, str):
        ident["name"] = target
        return ident
    if not target.exists():
        raise DataError(f"{target}: local dataset not found")
    files = [target] if target.is_file() else sorted(p for p in target.rglob("*") if p.is_file())
    ident["files"] = file_stats(target, files)
    return ident


def iter_hf(cfg: DataConfig, data_dir: Path) -> Iterator[Document]:
    """Stream the non-blank strings of `cfg.text_column` from split `cfg.hf_split`."""
    try:
        import datasets  # optional: only `hf:` sources need it
    except ImportError:
        raise DataError(f"the 'hf:' data source needs the datasets package: {HF_PIP}") from None
    target = hf_target(cfg.source)
    kwargs: dict[str, Any] = {
        "split": cfg.hf_split,
        "streaming": True,
        "cache_dir": str(data_dir / "hf"),  # lock files and hub metadata stay in hetnode's data dir
    }
    if cfg.hf_subset:
        kwargs["name"] = cfg.hf_subset
    if isinstance(target, str):
        path: str = target
    elif not target.exists():
        raise DataError(f"{target}: local dataset not found")
    elif target.is_file():
        builder = BUILDERS.get(target.suffix)
        if builder is None:
            raise DataError(f"{target}: cannot tell the format (expected one of {', '.join(BUILDERS)})")
        path, kwargs["data_files"] = builder, {cfg.hf_split: str(target)}
    else:
        path = str(target)
    try:
        stream = datasets.load_dataset(path, **kwargs)
    except Exception as exc:  # datasets raises many types: not found, offline, unknown split, bad files
        raise DataError(f"{cfg.source}: datasets.load_dataset failed ({type(exc).__name__}: {exc})") from None
    yield from _rows(cfg, stream)


def _rows(cfg: DataConfig, stream: Any) -> Iterator[Document]:
    column = cfg.text_column
    names = stream.column_names
    if names is not None and column not in names:
        listed = ", ".join(names)
        raise DataConfigError(f"{cfg.source}: no column {column!r} (columns: {listed}); set data.text_column")
    skipped = SkippedRows(cfg.source, column)
    rows = iter(stream)
    index = 0
    try:
        while True:
            try:
                row = next(rows, None)
            except Exception as exc:  # a bad file surfaces while streaming, as any datasets error
                raise DataError(
                    f"{cfg.source}: reading row {index} failed ({type(exc).__name__}: {exc})"
                ) from None
            if row is None:
                return
            if column not in row:
                raise DataError(f"{cfg.source}: row {index} has no column {column!r} (has {', '.join(row)})")
            value = row[column]
            if value is None:
                skipped.nulls += 1
            elif not isinstance(value, str):
                raise DataError(
                    f"{cfg.source}: row {index}: column {column!r} holds {type(value).__name__}, not text"
                )
            elif value.strip():
                yield Document(f"{cfg.hf_split}#{index}", value)
            else:
                skipped.blank += 1
            index += 1
    finally:
        skipped.report()
