"""`hf:` sources through `datasets`, on local files only: these tests never touch the network."""

import sys
from pathlib import Path

import pytest

from hetnode.config import DataConfig
from hetnode.data import TokenDataset, load_documents
from hetnode.data.hf import hf_target
from hetnode.data.sources import iter_documents
from hetnode.errors import DataError

datasets = pytest.importorskip("datasets")
huggingface_hub = pytest.importorskip("huggingface_hub")


@pytest.fixture(autouse=True)
def offline(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """No download, whatever was imported first: the env for anything read later, the flags read at import."""
    for var in ("HF_DATASETS_OFFLINE", "HF_HUB_OFFLINE"):
        monkeypatch.setenv(var, "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf-home"))
    monkeypatch.setattr(datasets.config, "HF_DATASETS_OFFLINE", True)
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)


def _texts(cfg: DataConfig, data_dir: Path) -> list[str]:
    return [d.text for d in iter_documents(cfg, data_dir)]


def test_local_parquet_file_and_folder_match_parquet_source(parquet_corpus, corpus, tmp_path: Path):
    root = parquet_corpus()
    expected = [d.text for d in load_documents(f"parquet:{root}")]
    assert expected == corpus
    folder = DataConfig(source=f"hf:{root}")
    assert _texts(folder, tmp_path) == expected
    single = DataConfig(source=f"hf:{root / 'part-0.parquet'}")
    docs = list(iter_documents(single, tmp_path))
    assert [d.text for d in docs] == corpus[:60]
    assert [d.key for d in docs[:2]] == ["train#0", "train#1"]  # <split>#<row> in stream order
    assert (tmp_path / "hf").is_dir()  # datasets' lock files stay in hetnode's data dir


def test_local_jsonl_with_another_field_and_nulls(make_jsonl, make_parquet, corpus, tmp_path: Path, caplog):
    path = make_jsonl(tmp_path / "docs.jsonl", corpus[:10], field="body")
    assert _texts(DataConfig(source=f"hf:{path}", text_column="body"), tmp_path) == corpus[:10]
    with pytest.raises(DataError, match=r"no column 'text' \(columns: body\)"):
        _texts(DataConfig(source=f"hf:{path}"), tmp_path)
    nulls = make_parquet(tmp_path / "n.parquet", ["a", None, "b"])
    docs = list(iter_documents(DataConfig(source=f"hf:{nulls}"), tmp_path))
    assert [(d.key, d.text) for d in docs] == [("train#0", "a"), ("train#2", "b")]
    assert "skipped 1 null row(s)" in caplog.text
    ints = make_parquet(tmp_path / "i.parquet", ["a"], id=[1])
    with pytest.raises(DataError, match="column 'id' holds int, not text"):
        _texts(DataConfig(source=f"hf:{ints}", text_column="id"), tmp_path)


def test_split_and_cap(make_parquet, corpus, tmp_path: Path):
    root = tmp_path / "splits"
    make_parquet(root / "train.parquet", corpus[:50])
    make_parquet(root / "test.parquet", corpus[50:60])
    assert _texts(DataConfig(source=f"hf:{root}", hf_split="test"), tmp_path) == corpus[50:60]
    assert _texts(DataConfig(source=f"hf:{root}", max_documents=7), tmp_path) == corpus[:7]
    with pytest.raises(DataError, match="load_dataset failed"):
        _texts(DataConfig(source=f"hf:{root}", hf_split="validation"), tmp_path)


def test_build_and_reuse(parquet_corpus, tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    cfg = DataConfig(source=f"hf:{parquet_corpus()}", seq_len=15, batch_size=2, eval_fraction=0.2)
    first = TokenDataset.build(cfg, vocab_size=320, seed=0, data_dir=tmp_path / "cache")

    def no_datasets(*args: object, **kwargs: object) -> None:
        raise AssertionError("the shards should have been reused")

    monkeypatch.setattr(datasets, "load_dataset", no_datasets)
    again = TokenDataset.build(cfg, vocab_size=320, seed=0, data_dir=tmp_path / "cache")
    x, y = first.train_batch(0, 1, 3), again.train_batch(0, 1, 3)
    assert (x[0] == y[0]).all() and first.eval_tokens == again.eval_tokens


def test_missing_datasets_names_the_extra(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setitem(sys.modules, "datasets", None)  # import datasets now raises ImportError
    with pytest.raises(DataError, match=r"pip install 'hetnode\[hf\]'"):
        _texts(DataConfig(source="hf:/nowhere"), tmp_path)


def test_local_paths_and_hub_names(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.chdir(tmp_path)
    assert hf_target("hf:HuggingFaceFW/fineweb-edu") == "HuggingFaceFW/fineweb-edu"
    assert hf_target("hf:./data") == Path("data")
    (tmp_path / "corpus").mkdir()
    assert hf_target("hf:corpus") == Path("corpus")  # an existing folder wins over a hub name
    with pytest.raises(DataError, match="local dataset not found"):
        _texts(DataConfig(source=f"hf:{tmp_path / 'missing'}"), tmp_path)
    with pytest.raises(DataError, match="load_dataset failed"):  # offline: a hub name cannot be fetched
        _texts(DataConfig(source="hf:hetnode-tests/no-such-dataset"), tmp_path)
