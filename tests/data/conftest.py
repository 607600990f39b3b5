"""Columnar fixtures the data tests write themselves: the same texts as Parquet and .jsonl.

(Tests run with --import-mode=importlib, so helpers are handed out as fixtures, not imported.)"""

import json
from collections.abc import Callable, Sequence
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

TOPICS = ("rivers", "cities", "music", "language", "science", "bridges", "forests", "trains")


def corpus_texts(n: int = 120) -> list[str]:
    """Documents long enough to fill a few windows; ü and 日本 exercise multi-byte UTF-8."""
    return [
        f"Document {i} is about {TOPICS[i % len(TOPICS)]} and ü {i * 7}. "
        + "日本 words repeat. " * (1 + i % 4)
        for i in range(n)
    ]


def write_parquet(path: Path, texts: Sequence[str | None], column: str = "text", **extra: list) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    table = pa.table({column: pa.array(list(texts), pa.string()), **extra})
    pq.write_table(table, path, row_group_size=25)  # several row groups: batches cross them
    return path


@pytest.fixture
def corpus() -> list[str]:
    return corpus_texts()


@pytest.fixture
def make_parquet() -> Callable[..., Path]:
    return write_parquet


@pytest.fixture
def make_jsonl() -> Callable[..., Path]:
    return write_jsonl


@pytest.fixture
def parquet_corpus(tmp_path: Path) -> Callable[..., Path]:
    """A folder of two Parquet files holding `corpus_texts()` in order (60 rows each)."""

    def make(folder: str = "pq", texts: Sequence[str] | None = None) -> Path:
        texts = corpus_texts() if texts is None else list(texts)
        half = len(texts) // 2
        root = tmp_path / folder
        write_parquet(root / "part-0.parquet", texts[:half])
        write_parquet(root / "sub" / "part-1.parquet", texts[half:])
        return root

    return make


def write_jsonl(path: Path, texts: Sequence[str], field: str = "text") -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(json.dumps({field: t}) for t in texts) + "\n", encoding="utf-8")
    return path
