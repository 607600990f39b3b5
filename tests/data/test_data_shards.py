"""Token shards: tokenised once, reused without reading the source, rebuilt when damaged or foreign."""

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from hetnode.cli.main import main
from hetnode.config import DataConfig
from hetnode.data import TokenDataset, columnar, shards
from hetnode.data.shards import Windows


@pytest.fixture
def reads(monkeypatch: pytest.MonkeyPatch) -> list[Path]:
    """Every Parquet file the data layer opens for reading."""
    opened: list[Path] = []
    real = columnar._parquet_slices

    def counting(file: Path, column: str):
        opened.append(file)
        return real(file, column)

    monkeypatch.setattr(columnar, "_parquet_slices", counting)
    return opened


def _cfg(root: Path, **changes) -> DataConfig:
    return DataConfig(source=f"parquet:{root}", seq_len=15, batch_size=2, eval_fraction=0.2, **changes)


def _same_batches(a: TokenDataset, b: TokenDataset) -> bool:
    pairs = [(a.train_batch(*args), b.train_batch(*args)) for args in [(0, 1, 0), (1, 2, 5), (0, 3, 400)]]
    pairs += list(zip(a.eval_batches(4), b.eval_batches(4), strict=True))
    return all(torch.equal(x[0], y[0]) and torch.equal(x[1], y[1]) for x, y in pairs)


def _folder(cache: Path) -> Path:
    [manifest] = cache.glob("tokens/*/manifest.json")
    return manifest.parent


def test_second_build_reuses_the_shards_without_reading(parquet_corpus, reads, tmp_path: Path):
    cfg, cache = _cfg(parquet_corpus()), tmp_path / "cache"
    first = TokenDataset.build(cfg, vocab_size=320, seed=3, data_dir=cache)
    assert len(reads) == 2  # both files, once
    second = TokenDataset.build(cfg, vocab_size=320, seed=3, data_dir=cache)
    assert len(reads) == 2 and _same_batches(first, second)
    assert isinstance(second._train, np.memmap)  # one shard: a view of the mapped file

    manifest = json.loads((_folder(cache) / "manifest.json").read_text())
    assert manifest["format"] == 1 and manifest["source"] == cfg.source and manifest["column"] == "text"
    assert manifest["tokenizer"] == {"kind": "bytes", "name": "bytes", "vocab_size": 257, "eos_id": 256}
    assert manifest["dtype"] == "<u2"
    assert manifest["train"]["tokens"] == first.train_tokens
    assert manifest["eval"]["tokens"] == first.eval_tokens
    assert manifest["documents"]["train"] + manifest["documents"]["eval"] == 120
    [shard] = manifest["train"]["shards"]
    assert shard["file"] == "train-00000.bin" and shard["tokens"] == first.train_tokens
    assert len(shard["sha256"]) == 64


def test_edited_source_is_tokenised_again(parquet_corpus, corpus, reads, tmp_path: Path):
    cfg, cache = _cfg(parquet_corpus()), tmp_path / "cache"
    first = TokenDataset.build(cfg, vocab_size=320, seed=0, data_dir=cache)
    parquet_corpus(texts=[t.upper() for t in corpus])  # same files, new contents
    second = TokenDataset.build(cfg, vocab_size=320, seed=0, data_dir=cache)
    assert len(reads) == 4 and len(list(cache.glob("tokens/*/manifest.json"))) == 2
    assert not _same_batches(first, second)
    # and so does another column, cap or eval fraction: each is part of the cache key
    TokenDataset.build(_cfg(cfg.source[8:], max_documents=100), vocab_size=320, seed=0, data_dir=cache)
    assert len(list(cache.glob("tokens/*/manifest.json"))) == 3


@pytest.mark.parametrize("damage", ["flip", "truncate", "delete"])
def test_damaged_shard_is_rebuilt(damage: str, parquet_corpus, reads, tmp_path: Path, caplog):
    cfg, cache = _cfg(parquet_corpus()), tmp_path / "cache"
    first = TokenDataset.build(cfg, vocab_size=320, seed=0, data_dir=cache)
    shard = _folder(cache) / "train-00000.bin"
    data = bytearray(shard.read_bytes())
    if damage == "flip":
        data[100] ^= 0x01  # same size, other content: only the digest tells
        shard.write_bytes(data)
    elif damage == "truncate":
        shard.write_bytes(data[:-2])
    else:
        shard.unlink()
    del first._train, first._eval  # release the maps before the folder is replaced
    again = TokenDataset.build(cfg, vocab_size=320, seed=0, data_dir=cache)
    assert len(reads) == 4
    assert "rebuilding token shards" in caplog.text
    reference = TokenDataset.build(cfg, vocab_size=320, seed=0, data_dir=tmp_path / "fresh")
    assert _same_batches(again, reference)
    assert len(list((cache / "tokens").iterdir())) == 1  # no build or old folder left behind


def test_manifest_of_another_tokenizer_is_rebuilt(parquet_corpus, reads, tmp_path: Path, caplog):
    cfg, cache = _cfg(parquet_corpus()), tmp_path / "cache"
    TokenDataset.build(cfg, vocab_size=320, seed=0, data_dir=cache)
    path = _folder(cache) / "manifest.json"
    manifest = json.loads(path.read_text())
    manifest["tokenizer"] = {"kind": "bpe", "name": "bpe-0123-v300", "vocab_size": 300, "eos_id": 0}
    path.write_text(json.dumps(manifest))
    ds = TokenDataset.build(cfg, vocab_size=320, seed=0, data_dir=cache)
    assert len(reads) == 4 and "manifest of another tokenizer" in caplog.text
    assert ds.tokenizer.name == "bytes"
    assert json.loads(path.read_text())["tokenizer"]["name"] == "bytes"


def test_bpe_shards_name_their_tokenizer_file(parquet_corpus, reads, tmp_path: Path, caplog):
    cfg, cache = _cfg(parquet_corpus(), tokenizer="bpe", bpe_vocab_size=300), tmp_path / "cache"
    first = TokenDataset.build(cfg, vocab_size=320, seed=0, data_dir=cache)
    assert len(reads) == 4  # one pass to learn the BPE from training texts, one to tokenise
    info = json.loads((_folder(cache) / "manifest.json").read_text())["tokenizer"]
    assert info["kind"] == "bpe" and (cache / info["file"]).is_file() and info["name"] == first.tokenizer.name
    again = TokenDataset.build(cfg, vocab_size=320, seed=0, data_dir=cache)
    assert len(reads) == 4 and _same_batches(first, again)
    (cache / info["file"]).unlink()  # the tokenizer the shards were made with is gone: start over
    TokenDataset.build(cfg, vocab_size=320, seed=0, data_dir=cache)
    assert len(reads) == 8 and "BPE tokenizer file" in caplog.text


def test_many_shards_read_as_one_stream(parquet_corpus, monkeypatch, tmp_path: Path):
    cfg = _cfg(parquet_corpus())
    one = TokenDataset.build(cfg, vocab_size=320, seed=1, data_dir=tmp_path / "one")
    monkeypatch.setattr(shards, "SHARD_TOKENS", 997)  # windows of 16 straddle shard ends
    many = TokenDataset.build(cfg, vocab_size=320, seed=1, data_dir=tmp_path / "many")
    manifest = json.loads((_folder(tmp_path / "many") / "manifest.json").read_text())
    assert len(manifest["train"]["shards"]) == -(-one.train_tokens // 997) > 5
    assert isinstance(many._train, Windows) and _same_batches(one, many)
    assert np.array_equal(many._train[:], np.asarray(one._train))
    assert np.array_equal(many._train[-1], one._train[-1])
    with pytest.raises(IndexError):
        many._train[len(many._train)]


def test_hetnode_data_does_not_import_datasets():
    """`datasets` is an optional extra: only an hf: source imports it."""
    code = "import sys, hetnode.data, hetnode.data.hf; assert 'datasets' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def test_train_cli_on_a_parquet_source(parquet_corpus, tmp_path: Path, capsys):
    root = parquet_corpus()
    config = tmp_path / "pq.toml"
    config.write_text(
        '[run]\nname = "pq"\n'
        f'[data]\nsource = "parquet:{root}"\nseq_len = 32\nbatch_size = 4\neval_fraction = 0.2\n'
        f'data_dir = "{tmp_path / "cache"}"\n'
        "[train]\nmax_steps = 3\neval_every = 3\neval_batches = 1\ncheckpoint_every = 3\nlog_every = 1\n"
    )
    out = tmp_path / "out"
    assert main(["train", "--config", str(config), "--out", str(out), "--no-progress"]) == 0
    assert "eval loss" in capsys.readouterr().out
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert max(r["step"] for r in records) == 3
    assert (tmp_path / "cache" / "tokens").is_dir()
