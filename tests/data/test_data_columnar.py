"""Parquet and Arrow sources: the same documents as `dir:`, stable keys, and clear errors for bad columns."""

import logging
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.feather as feather
import pyarrow.parquet as pq
import pytest

from hetnode.config import DataConfig
from hetnode.data import TokenDataset, is_eval_key, load_documents, split_documents
from hetnode.data.sources import iter_documents
from hetnode.errors import DataError


def _stream(ds: TokenDataset, split: str) -> np.ndarray:
    rows = ds._train if split == "train" else ds._eval
    return np.concatenate([np.asarray(r) for r in rows])


def _bytes_stream(texts: list[str], limit: int) -> np.ndarray:
    ids = [t for text in texts for t in (*text.encode("utf-8"), 256)]
    return np.array(ids[:limit], dtype=np.uint16)


def test_parquet_gives_the_documents_and_stream_of_dir(parquet_corpus, make_jsonl, corpus, tmp_path: Path):
    root = parquet_corpus()
    make_jsonl(tmp_path / "jsonl" / "docs.jsonl", corpus)
    docs = load_documents(f"parquet:{root}")
    assert [d.text for d in docs] == [d.text for d in load_documents(f"dir:{tmp_path / 'jsonl'}")] == corpus
    # keys are <relative path>#<row index>: they fix the eval split
    assert [d.key for d in docs[:2]] == ["part-0.parquet#0", "part-0.parquet#1"]
    assert docs[-1].key == "sub/part-1.parquet#59"

    cfg = DataConfig(source=f"parquet:{root}", seq_len=31, batch_size=2, eval_fraction=0.2)
    ds = TokenDataset.build(cfg, vocab_size=320, seed=0, data_dir=tmp_path / "cache")
    train_docs, eval_docs = split_documents(docs, 0.2)
    assert ds.train_tokens == sum(len(d.text.encode()) + 1 for d in train_docs)
    assert ds.eval_tokens == sum(len(d.text.encode()) + 1 for d in eval_docs)
    # the windows hold exactly the byte ids of the split's texts, each followed by eos (256)
    train = _stream(ds, "train")
    assert np.array_equal(train, _bytes_stream([d.text for d in train_docs], train.size))
    held = _stream(ds, "eval")
    assert np.array_equal(held, _bytes_stream([d.text for d in eval_docs], held.size))


def test_eval_split_is_deterministic(parquet_corpus, tmp_path: Path):
    root = parquet_corpus()
    cfg = DataConfig(source=f"parquet:{root}", seq_len=15, batch_size=2, eval_fraction=0.2)
    first = TokenDataset.build(cfg, vocab_size=320, seed=0, data_dir=tmp_path / "a")
    second = TokenDataset.build(cfg, vocab_size=320, seed=0, data_dir=tmp_path / "b")
    assert np.array_equal(_stream(first, "eval"), _stream(second, "eval"))
    held = [d.key for d in load_documents(f"parquet:{root}") if is_eval_key(d.key, 0.2)]
    assert held == [k for k in (f"part-0.parquet#{i}" for i in range(60)) if is_eval_key(k, 0.2)] + [
        k for k in (f"sub/part-1.parquet#{i}" for i in range(60)) if is_eval_key(k, 0.2)
    ]
    assert 10 < len(held) < 40


def test_arrow_file_stream_and_feather(make_parquet, corpus, tmp_path: Path):
    table = pa.table({"id": list(range(len(corpus))), "text": corpus})
    root = tmp_path / "arrow"
    root.mkdir()
    with pa.ipc.new_file(root / "a.arrow", table.schema) as writer:  # random-access file format
        writer.write_table(table, max_chunksize=50)
    with pa.ipc.new_stream(root / "b.arrow", table.schema) as writer:  # what `datasets` caches
        writer.write_table(table)
    feather.write_feather(table, root / "c.feather")
    (root / "ignored.txt").write_text("not a table")
    docs = load_documents(f"arrow:{root}")
    assert [d.text for d in docs] == corpus * 3
    assert [d.key for d in docs[::120]] == ["a.arrow#0", "b.arrow#0", "c.feather#0"]
    single = load_documents(f"arrow:{root / 'b.arrow'}")
    assert [d.key for d in single[:2]] == ["b.arrow#0", "b.arrow#1"]
    with pytest.raises(DataError, match="not a readable Arrow IPC"):
        load_documents(f"arrow:{make_parquet(tmp_path / 'x.parquet', corpus)}")


def test_other_column_and_missing_column(make_parquet, corpus, tmp_path: Path):
    path = make_parquet(tmp_path / "t.parquet", corpus, column="body", id=list(range(len(corpus))))
    with pytest.raises(DataError, match=r"t\.parquet: no column 'text' \(columns: body, id\)"):
        load_documents(f"parquet:{path}")
    assert [d.text for d in load_documents(f"parquet:{path}", text_column="body")] == corpus
    cfg = DataConfig(source=f"parquet:{path}", text_column="id")
    with pytest.raises(DataError, match="column 'id' holds int64, not text"):
        list(iter_documents(cfg, tmp_path))


def test_null_and_blank_rows_are_skipped_and_counted(make_parquet, tmp_path: Path, caplog):
    path = make_parquet(tmp_path / "n.parquet", ["one", None, "  ", "four", None])
    with caplog.at_level(logging.WARNING):
        docs = load_documents(f"parquet:{path}")
    assert [(d.key, d.text) for d in docs] == [("n.parquet#0", "one"), ("n.parquet#3", "four")]
    assert "skipped 2 null row(s) in column 'text' (and 1 blank)" in caplog.text
    only_nulls = make_parquet(tmp_path / "empty" / "e.parquet", [None, None])
    cfg = DataConfig(source=f"parquet:{only_nulls.parent}", seq_len=8, batch_size=2)
    with pytest.raises(DataError, match="no documents"):
        TokenDataset.build(cfg, vocab_size=320, seed=0, data_dir=tmp_path / "cache")


def test_max_documents_takes_the_first_ones(parquet_corpus, corpus, tmp_path: Path):
    cfg = DataConfig(source=f"parquet:{parquet_corpus()}", max_documents=70)
    assert [d.text for d in iter_documents(cfg, tmp_path)] == corpus[:70]


@pytest.mark.parametrize("kind", ["parquet", "arrow"])
def test_bad_paths_and_files_name_the_file(kind: str, tmp_path: Path):
    with pytest.raises(DataError, match="source not found"):
        load_documents(f"{kind}:{tmp_path / 'missing'}")
    (tmp_path / "empty").mkdir()
    with pytest.raises(DataError, match="no .* files found"):
        load_documents(f"{kind}:{tmp_path / 'empty'}")
    bad = tmp_path / f"bad.{kind}"
    bad.write_bytes(b"this is not a columnar file at all")
    with pytest.raises(DataError, match=r"bad\.\w+: not a readable"):
        load_documents(f"{kind}:{bad}")


def test_parquet_is_read_in_bounded_batches(make_parquet, tmp_path: Path, monkeypatch):
    from hetnode.data import columnar

    path = make_parquet(tmp_path / "big.parquet", [f"row {i}" for i in range(1000)])
    monkeypatch.setattr(columnar, "BATCH_ROWS", 64)
    sizes = [len(s) for s in columnar._parquet_slices(path, "text")]
    assert max(sizes) <= 64 and sum(sizes) == 1000
    assert pq.ParquetFile(path).metadata.num_row_groups == 40
