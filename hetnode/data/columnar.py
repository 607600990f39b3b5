"""Parquet and Arrow IPC sources: one document per row of a text column, read a slice of rows at a time.

A source is a file or a folder searched recursively (files in sorted relative-path order). A row's key is
`<relative path>#<row index>`, so the eval split is fixed by where a row sits, on every peer. Only the text
column is read, in record batches of at most `BATCH_ROWS` rows, so memory stays bounded however large the
files are. Null rows are skipped and counted (real dumps have them); a column that is not text is an error.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from hetnode.data.documents import Document, SkippedRows, file_stats
from hetnode.errors import DataConfigError, DataError

SUFFIXES = {"parquet": (".parquet",), "arrow": (".arrow", ".feather", ".ipc")}
BATCH_ROWS = 1024


def columnar_files(kind: str, path: Path) -> list[tuple[str, Path]]:
    """(relative name, file) of a source: a named file is read whatever its suffix, a folder by suffix."""
    if not path.exists():
        raise DataConfigError(f"{path}: {kind} source not found")
    if path.is_file():
        return [(path.name, path)]
    suffixes = SUFFIXES[kind]
    files = sorted(
        (p.relative_to(path).as_posix(), p) for p in path.rglob("*") if p.suffix in suffixes and p.is_file()
    )
    if not files:
        raise DataError(f"{path}: no {' / '.join(suffixes)} files found (searched recursively)")
    return files


def columnar_identity(kind: str, path: Path) -> list[list[str | int]]:
    return file_stats(path, [file for _, file in columnar_files(kind, path)])


def iter_columnar(kind: str, path: Path, column: str) -> Iterator[Document]:
    """The non-blank strings of `column`, file by file, row by row."""
    skipped = SkippedRows(f"{kind}:{path}", column)
    try:
        for rel, file in columnar_files(kind, path):
            row = 0
            batches = _parquet_slices(file, column) if kind == "parquet" else _arrow_slices(file, column)
            for values in batches:
                for value in values:
                    if value is None:
                        skipped.nulls += 1
                    elif value.strip():
                        yield Document(f"{rel}#{row}", value)
                    else:
                        skipped.blank += 1
                    row += 1
    finally:
        skipped.report()


def _check_column(file: Path, schema: pa.Schema, column: str) -> None:
    if column not in schema.names:
        raise DataConfigError(
            f"{file}: no column {column!r} (columns: {', '.join(schema.names) or 'none'}); "
            "set data.text_column"
        )
    kind = schema.field(column).type
    if pa.types.is_dictionary(kind):
        kind = kind.value_type
    if not (pa.types.is_string(kind) or pa.types.is_large_string(kind) or pa.types.is_string_view(kind)):
        raise DataConfigError(f"{file}: column {column!r} holds {kind}, not text; set data.text_column")


def _parquet_slices(file: Path, column: str) -> Iterator[list[str | None]]:
    try:
        reader = pq.ParquetFile(file, memory_map=True)
    except (pa.ArrowException, OSError) as exc:
        raise DataError(f"{file}: not a readable Parquet file ({exc})") from None
    _check_column(file, reader.schema_arrow, column)
    batches = reader.iter_batches(batch_size=BATCH_ROWS, columns=[column])
    while True:
        try:
            batch = next(batches, None)
        except (pa.ArrowException, OSError) as exc:
            raise DataError(f"{file}: cannot read column {column!r} ({exc})") from None
        if batch is None:
            return
        yield batch.column(0).to_pylist()


def _arrow_slices(file: Path, column: str) -> Iterator[list[str | None]]:
    """Both IPC formats: the random-access file format (Feather v2, `.arrow` from pyarrow's writers) and the
    stream format (what `datasets` caches as `.arrow`). One batch may be a whole table, so it is sliced."""
    try:
        mapped = pa.memory_map(str(file))
        try:
            file_reader = pa.ipc.open_file(mapped)
            schema = file_reader.schema
            batches: Iterator[pa.RecordBatch] = (
                file_reader.get_batch(i) for i in range(file_reader.num_record_batches)
            )
        except pa.ArrowInvalid:
            mapped.seek(0)
            stream_reader = pa.ipc.open_stream(mapped)
            schema = stream_reader.schema
            batches = iter(stream_reader)
    except (pa.ArrowException, OSError) as exc:
        raise DataError(f"{file}: not a readable Arrow IPC file or stream ({exc})") from None
    _check_column(file, schema, column)
    index = schema.get_field_index(column)
    while True:
        try:
            batch = next(batches, None)
        except (pa.ArrowException, OSError) as exc:
            raise DataError(f"{file}: cannot read column {column!r} ({exc})") from None
        if batch is None:
            return
        values = batch.column(index)
        for start in range(0, len(values), BATCH_ROWS):
            yield values.slice(start, BATCH_ROWS).to_pylist()
