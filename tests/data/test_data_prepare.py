"""`hetnode data prepare` end to end: a Parquet set written here becomes shards and a tokenizer.json that a
`tokens:` source trains on, with the tokenizer pinned by sha256 and every mismatch refused by name."""

import hashlib
import json
import re
from pathlib import Path

import numpy as np
import pytest

from hetnode.cli.main import EXIT_USAGE, main
from hetnode.config import Config, dump_config, replace
from hetnode.data import BpeTokenizer, TokenDataset, load_documents, split_documents
from hetnode.errors import DataConfigError, DataError

BPE_DOCS = 40


@pytest.fixture
def bpe_config(tiny_config: Config, tmp_path: Path) -> Config:
    data = {"tokenizer": "bpe", "bpe_vocab_size": 300, "seq_len": 31, "batch_size": 2, "eval_fraction": 0.2}
    return replace(tiny_config, "data", data_dir=str(tmp_path / "cache"), **data)


@pytest.fixture
def prepared(bpe_config: Config, parquet_corpus, tmp_path: Path, capsys) -> tuple[Path, Path, dict]:
    """(parquet folder, prepared folder, the config lines it printed)."""
    root = parquet_corpus()
    config_path = tmp_path / "run.toml"
    config_path.write_text(dump_config(bpe_config))
    out = tmp_path / "prepared"
    argv = ["data", "prepare", "--config", str(config_path), "--source", f"parquet:{root}", "--out", str(out)]
    assert main([*argv, "--bpe-documents", str(BPE_DOCS)]) == 0
    printed = dict(re.findall(r'^(source|tokenizer_sha256) = "(.*)"$', capsys.readouterr().out, re.MULTILINE))
    return root, out, printed


def test_prepare_writes_shards_and_a_pinned_tokenizer_that_training_reads(bpe_config, prepared):
    root, out, printed = prepared
    assert printed["source"] == f"tokens:{out}"
    tokenizer_file = out / "tokenizer.json"
    sha = hashlib.sha256(tokenizer_file.read_bytes()).hexdigest()
    assert printed["tokenizer_sha256"] == sha
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["tokenizer"]["sha256"] == sha and manifest["tokenizer"]["documents"] == BPE_DOCS
    assert sorted(p.name for p in out.iterdir()) == [
        "eval-00000.bin",
        "manifest.json",
        "tokenizer.json",
        "train-00000.bin",
    ]

    # the BPE learnt from the first BPE_DOCS training documents only, as a peer would train it on them
    train_docs, eval_docs = split_documents(load_documents(f"parquet:{root}"), 0.2)
    expected = BpeTokenizer.train([d.text for d in train_docs[:BPE_DOCS]], 300, "x")
    assert json.loads(tokenizer_file.read_text())["model"] == json.loads(expected.to_json())["model"]

    cfg = replace(bpe_config, "data", source=printed["source"], tokenizer_sha256=sha).data
    ds = TokenDataset.build(cfg, vocab_size=320, seed=0, data_dir=Path(bpe_config.data.data_dir))
    assert isinstance(ds.tokenizer, BpeTokenizer) and ds.tokenizer.to_json() == tokenizer_file.read_text()
    # the train stream is every training document in source order, tokenised, each followed by eos
    eos = ds.tokenizer.eos_id
    stream = [i for d in train_docs for i in (*ds.tokenizer.encode(d.text), eos)]
    assert ds.train_tokens == len(stream) == manifest["train"]["tokens"]
    assert ds.eval_tokens == sum(len(ds.tokenizer.encode(d.text)) + 1 for d in eval_docs)
    assert np.array_equal(np.asarray(ds._train[0]), np.array(stream[:32], dtype=np.uint16))
    assert not (Path(bpe_config.data.data_dir) / "tokens").exists()  # nothing tokenised again


def test_a_tokens_source_refuses_an_unpinned_or_foreign_tokenizer(bpe_config, prepared):
    _, out, printed = prepared
    data_dir = Path(bpe_config.data.data_dir)
    base = replace(bpe_config, "data", source=printed["source"])
    with pytest.raises(DataConfigError, match=f'tokenizer_sha256 = "{printed["tokenizer_sha256"]}"'):
        TokenDataset.build(base.data, 320, 0, data_dir)
    other = replace(base, "data", tokenizer_sha256="0" * 64)
    with pytest.raises(DataConfigError, match="prepared with another tokenizer"):
        TokenDataset.build(other.data, 320, 0, data_dir)
    pinned = replace(base, "data", tokenizer_sha256=printed["tokenizer_sha256"])
    with pytest.raises(DataConfigError, match=r"data.eval_fraction = 0.2"):
        TokenDataset.build(replace(pinned, "data", eval_fraction=0.1).data, 320, 0, data_dir)
    with pytest.raises(DataConfigError, match="data.bpe_vocab_size = 300"):
        TokenDataset.build(replace(pinned, "data", bpe_vocab_size=320).data, 320, 0, data_dir)
    with pytest.raises(DataConfigError, match="more than model.vocab_size"):
        TokenDataset.build(pinned.data, 280, 0, data_dir)
    # a damaged copy: a flipped byte in a shard, then an edited tokenizer
    shard = out / "train-00000.bin"
    raw = bytearray(shard.read_bytes())
    raw[0] ^= 1
    shard.write_bytes(bytes(raw))
    with pytest.raises(DataError, match="sha256"):
        TokenDataset.build(pinned.data, 320, 0, data_dir)
    with pytest.raises(DataConfigError, match="hetnode data prepare"):
        TokenDataset.build(replace(pinned, "data", source=f"tokens:{out}-missing").data, 320, 0, data_dir)


def test_prepare_refuses_bad_flags_and_an_existing_folder(bpe_config, prepared, tmp_path: Path, capsys):
    root, out, _ = prepared
    config_path = tmp_path / "run.toml"
    base = ["data", "prepare", "--config", str(config_path)]
    cases = [
        ([*base, "--source", f"parquet:{root}", "--out", str(out)], "already exists"),
        (
            [*base, "--source", f"parquet:{root}", "--out", str(tmp_path / "b"), "--bpe-documents", "0"],
            "--bpe",
        ),
        ([*base, "--source", f"tokens:{out}", "--out", str(tmp_path / "c")], "already tokenised"),
        ([*base, "--source", "nope", "--out", str(tmp_path / "d")], "--source"),
        (
            [*base, "--source", f"parquet:{root}", "--out", str(tmp_path / "e"), "--text-column", "body"],
            "body",
        ),
    ]
    for argv, message in cases:
        capsys.readouterr()
        assert main(argv) == EXIT_USAGE, argv
        assert message in capsys.readouterr().err, argv
    assert not any((tmp_path / name).exists() for name in "bcde")


def test_a_byte_tokenizer_folder_has_no_tokenizer_file_and_no_hash(
    tiny_config, parquet_corpus, tmp_path, capsys
):
    root = parquet_corpus()
    config = replace(tiny_config, "data", seq_len=31, batch_size=2, eval_fraction=0.2)
    config_path = tmp_path / "bytes.toml"
    config_path.write_text(dump_config(config))
    out = tmp_path / "bytes"
    argv = ["data", "prepare", "--config", str(config_path), "--source", f"parquet:{root}", "--out", str(out)]
    assert main(argv) == 0
    printed = capsys.readouterr().out
    assert f'source = "tokens:{out}"' in printed and "tokenizer_sha256" not in printed
    assert not (out / "tokenizer.json").exists()
    cfg = replace(config, "data", source=f"tokens:{out}").data
    ds = TokenDataset.build(cfg, vocab_size=320, seed=0, data_dir=tmp_path / "cache")
    train_docs, _ = split_documents(load_documents(f"parquet:{root}"), 0.2)
    assert ds.tokenizer.name == "bytes" and ds.train_tokens == sum(
        len(d.text.encode()) + 1 for d in train_docs
    )
    pinned = replace(config, "data", source=f"tokens:{out}", tokenizer_sha256="a" * 64).data
    with pytest.raises(DataConfigError, match="byte tokenizer has no file"):
        TokenDataset.build(pinned, vocab_size=320, seed=0, data_dir=tmp_path)
