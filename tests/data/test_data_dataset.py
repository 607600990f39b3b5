"""Token streams, the eval split and the per-slot schedule: deterministic, disjoint, never trained on eval."""

import json
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from hetnode.config import DataConfig
from hetnode.data import ByteTokenizer, TokenDataset, is_eval_key, load_documents, split_documents
from hetnode.data import streams as streams_module
from hetnode.data.dataset import epoch_permutation
from hetnode.data.tokenizer import bpe_cache_path
from hetnode.errors import DataError

WIKI = DataConfig()  # source="wiki", bytes, seq_len 128, batch 16, eval_fraction 0.02


@pytest.fixture(scope="module")
def wiki_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("wiki-cache")


@pytest.fixture(scope="module")
def wiki(wiki_dir: Path) -> TokenDataset:
    start = time.perf_counter()
    ds = TokenDataset.build(WIKI, vocab_size=320, seed=0, data_dir=wiki_dir)
    assert time.perf_counter() - start < 10
    return ds


def test_wiki_size_and_description(wiki: TokenDataset):
    assert wiki.train_tokens > 3_000_000
    assert 0.01 * wiki.train_tokens < wiki.eval_tokens < 0.04 * wiki.train_tokens
    assert wiki.num_train_windows == wiki.train_tokens // 129
    assert isinstance(wiki.tokenizer, ByteTokenizer)
    line = wiki.describe()
    assert "\n" not in line
    assert "wiki" in line and "bytes" in line and f"{wiki.train_tokens:,}" in line


def test_second_build_uses_the_token_cache(
    wiki: TokenDataset, wiki_dir: Path, monkeypatch: pytest.MonkeyPatch
):
    [manifest] = wiki_dir.glob("tokens/*/manifest.json")
    assert json.loads(manifest.read_text())["tokenizer"]["name"] == "bytes"

    def no_encoding(*args: object) -> np.ndarray:
        raise AssertionError("the cached token streams should have been loaded")

    monkeypatch.setattr(streams_module, "_encode", no_encoding)
    monkeypatch.setattr(streams_module, "iter_documents", no_encoding)
    again = TokenDataset.build(WIKI, vocab_size=320, seed=0, data_dir=wiki_dir)
    assert (again.train_tokens, again.eval_tokens) == (wiki.train_tokens, wiki.eval_tokens)
    for a, b in zip(again.eval_batches(3), wiki.eval_batches(3), strict=True):
        assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


def test_wiki_eval_documents_are_never_trained_on(wiki: TokenDataset):
    docs = load_documents("wiki")
    train_docs, eval_docs = split_documents(docs, WIKI.eval_fraction)
    train_keys, eval_keys = {d.key for d in train_docs}, {d.key for d in eval_docs}
    assert eval_keys and not train_keys & eval_keys
    assert train_keys | eval_keys == {d.key for d in docs}
    # the streams are exactly the assigned documents, each followed by eos
    assert wiki.train_tokens == sum(len(d.text.encode("utf-8")) + 1 for d in train_docs)
    assert wiki.eval_tokens == sum(len(d.text.encode("utf-8")) + 1 for d in eval_docs)
    first_eval = wiki.eval_batches(1)[0][0][0].tolist()
    assert bytes(first_eval[:64]) == eval_docs[0].text.encode("utf-8")[:64]
    # and no eval window shows up as a training window
    train_windows = {w.tobytes() for w in wiki._train}
    assert not any(w.tobytes() in train_windows for w in wiki._eval)


def test_eval_split_is_stable():
    """Golden values: changing the split hash would silently move documents between train and eval."""
    assert [is_eval_key(k, 0.02) for k in ("Alan Turing", "a", "x")] == [False, False, False]
    assert is_eval_key("x", 0.53) and not is_eval_key("x", 0.52)
    assert is_eval_key("hetnode", 0.58) and not is_eval_key("hetnode", 0.57)
    _, eval_docs = split_documents(load_documents("wiki"), 0.02)
    assert (len(eval_docs), eval_docs[0].key) == (222, "Accounting")


def test_epoch_permutation_is_golden():
    """Peers on other machines and numpy versions must derive the same window order."""
    assert epoch_permutation(10, 0, 0).tolist() == [3, 2, 1, 8, 6, 0, 7, 4, 5, 9]
    assert epoch_permutation(10, 0, 1).tolist() == [7, 4, 5, 1, 9, 8, 6, 2, 0, 3]
    assert epoch_permutation(10, 1, 0).tolist() == [9, 2, 4, 7, 5, 0, 8, 6, 3, 1]


def test_train_batch_shapes_and_shift(wiki: TokenDataset):
    x, y = wiki.train_batch(slot=2, num_slots=4, step=11)
    assert x.shape == y.shape == (16, 128)
    assert x.dtype == y.dtype == torch.int64
    assert torch.equal(x[:, 1:], y[:, :-1])
    assert int(x.max()) < 257


def test_train_batch_is_deterministic(wiki: TokenDataset, wiki_dir: Path):
    other = TokenDataset.build(WIKI, vocab_size=320, seed=0, data_dir=wiki_dir)
    for args in [(0, 1, 0), (3, 4, 7), (1, 4, 10_000)]:
        a, b = wiki.train_batch(*args), other.train_batch(*args)
        assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    reseeded = TokenDataset.build(WIKI, vocab_size=320, seed=1, data_dir=wiki_dir)
    assert not torch.equal(reseeded.train_batch(0, 4, 0)[0], wiki.train_batch(0, 4, 0)[0])


def test_slots_are_disjoint_and_an_epoch_never_repeats(wiki: TokenDataset):
    slots, per_step = 4, 4 * wiki.batch_size
    steps_per_epoch = wiki.num_train_windows // per_step
    epoch = [
        np.stack([wiki.windows_for(s, slots, step) for s in range(slots)]) for step in range(steps_per_epoch)
    ]
    seen = np.concatenate([e.ravel() for e in epoch])
    assert len(np.unique(seen)) == seen.size == steps_per_epoch * per_step
    # the steps around the epoch boundary, and far beyond it
    for step in [steps_per_epoch - 1, steps_per_epoch, steps_per_epoch + 1, 5 * steps_per_epoch + 3]:
        ids = np.concatenate([wiki.windows_for(s, slots, step) for s in range(slots)])
        assert len(np.unique(ids)) == ids.size
    assert not np.array_equal(wiki.windows_for(0, slots, 0), wiki.windows_for(0, slots, steps_per_epoch))


def _tiny(num_windows: int = 10, batch_size: int = 2, seq_len: int = 3, seed: int = 0) -> TokenDataset:
    width = seq_len + 1
    train = np.arange(num_windows * width + 2, dtype=np.uint16)  # +2 leftover tokens are dropped
    held = np.arange(1000, 1000 + 3 * batch_size * width, dtype=np.uint16)
    return TokenDataset(
        source="test",
        tokenizer=ByteTokenizer(),
        train=train,
        held_out=held,
        seq_len=seq_len,
        batch_size=batch_size,
        seed=seed,
    )


@pytest.mark.parametrize("num_slots", [1, 2, 3, 5])
def test_schedule_on_a_tiny_stream(num_slots: int):
    ds = _tiny()
    steps_per_epoch = 10 // (num_slots * 2)
    for epoch in range(4):
        seen = []
        for step in range(epoch * steps_per_epoch, (epoch + 1) * steps_per_epoch):
            ids = np.concatenate([ds.windows_for(s, num_slots, step) for s in range(num_slots)])
            assert len(set(ids.tolist())) == ids.size
            seen.extend(ids.tolist())
        assert len(set(seen)) == len(seen)
        assert set(seen) <= set(range(10))
    x, y = ds.train_batch(0, num_slots, 0)
    window = int(ds.windows_for(0, num_slots, 0)[0])
    assert x[0].tolist() == list(range(window * 4, window * 4 + 3))
    assert y[0].tolist() == list(range(window * 4 + 1, window * 4 + 4))


@pytest.mark.parametrize(("slot", "num_slots", "step"), [(-1, 4, 0), (4, 4, 0), (0, 0, 0), (0, 4, -1)])
def test_schedule_rejects_bad_arguments(slot: int, num_slots: int, step: int):
    with pytest.raises(ValueError):
        _tiny().windows_for(slot, num_slots, step)


def test_too_many_slots_for_the_data():
    with pytest.raises(DataError, match="10 training windows cannot feed 6 slots"):
        _tiny().windows_for(0, 6, 0)


def test_eval_batches_are_fixed_and_in_order():
    ds = _tiny()
    batches = ds.eval_batches(2)
    assert len(batches) == 2
    assert batches[0][0][0].tolist() == [1000, 1001, 1002]
    assert batches[0][1][0].tolist() == [1001, 1002, 1003]
    assert batches[1][0][0].tolist() == [1008, 1009, 1010]
    again = ds.eval_batches(2)
    assert all(
        torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]) for a, b in zip(batches, again, strict=True)
    )
    assert len(ds.eval_batches(100)) == 3  # only what there is
    with pytest.raises(ValueError):
        ds.eval_batches(0)


def _jsonl_corpus(root: Path, n: int = 80) -> None:
    root.mkdir(parents=True, exist_ok=True)
    lines = [
        json.dumps({"text": f"Document number {i} talks about rivers, cities and music. " * 3})
        for i in range(n)
    ]
    (root / "docs.jsonl").write_text("\n".join(lines), encoding="utf-8")
    (root / "notes.txt").write_text("A plain text note about language and science.", encoding="utf-8")


def test_dir_source_end_to_end(tmp_path: Path):
    _jsonl_corpus(tmp_path / "corpus")
    cfg = DataConfig(source=f"dir:{tmp_path / 'corpus'}", seq_len=16, batch_size=2, eval_fraction=0.3)
    ds = TokenDataset.build(cfg, vocab_size=257, seed=0, data_dir=tmp_path / "cache")
    train_docs, eval_docs = split_documents(load_documents(cfg.source), 0.3)
    assert ds.train_tokens == sum(len(d.text.encode()) + 1 for d in train_docs)
    assert ds.eval_tokens == sum(len(d.text.encode()) + 1 for d in eval_docs)
    x, y = ds.train_batch(1, 2, 3)
    assert x.shape == (2, 16)


def test_bpe_dataset_trains_on_train_documents_only(tmp_path: Path):
    _jsonl_corpus(tmp_path / "corpus")
    cfg = DataConfig(
        source=f"dir:{tmp_path / 'corpus'}",
        tokenizer="bpe",
        bpe_vocab_size=300,
        seq_len=8,
        batch_size=2,
        eval_fraction=0.3,
    )
    ds = TokenDataset.build(cfg, vocab_size=320, seed=0, data_dir=tmp_path)
    train_docs, _ = split_documents(load_documents(cfg.source), 0.3)
    cache = bpe_cache_path(tmp_path, [d.text for d in train_docs], 300)
    assert cache.is_file() and ds.tokenizer.name == cache.stem
    x, _ = ds.train_batch(0, 1, 0)
    assert int(x.max()) < ds.tokenizer.vocab_size <= 300
    with pytest.raises(DataError, match="more than the model vocab 280"):
        TokenDataset.build(cfg, vocab_size=280, seed=0, data_dir=tmp_path)


def test_bin_source_splits_off_the_tail(tmp_path: Path):
    path = tmp_path / "tokens.bin"
    stream = (np.arange(2000) % 320).astype("<u2")
    stream.tofile(path)
    cfg = DataConfig(source=f"bin:{path}", seq_len=9, batch_size=4, eval_fraction=0.1)
    ds = TokenDataset.build(cfg, vocab_size=320, seed=0, data_dir=tmp_path)
    assert (ds.train_tokens, ds.eval_tokens) == (1800, 200)
    x, y = ds.eval_batches(1)[0]
    assert x[0].tolist() == stream[1800:1809].tolist() and y[0].tolist() == stream[1801:1810].tolist()
    window = int(ds.windows_for(0, 1, 0)[0])
    assert ds.train_batch(0, 1, 0)[0][0].tolist() == stream[window * 10 : window * 10 + 9].tolist()


def test_too_little_data(tmp_path: Path):
    _jsonl_corpus(tmp_path / "corpus", n=40)
    source = f"dir:{tmp_path / 'corpus'}"
    cfg = DataConfig(source=source, seq_len=128, batch_size=64, eval_fraction=0.3)
    with pytest.raises(DataError, match="too little training data") as info:
        TokenDataset.build(cfg, vocab_size=257, seed=0, data_dir=tmp_path)
    assert str(tmp_path / "corpus") in str(info.value)
    cfg = DataConfig(source=source, seq_len=128, batch_size=4, eval_fraction=0.01)
    with pytest.raises(DataError, match="eval") as info:
        TokenDataset.build(cfg, vocab_size=257, seed=0, data_dir=tmp_path)
    assert str(tmp_path / "corpus") in str(info.value)


def test_single_document_cannot_be_split(tmp_path: Path):
    (tmp_path / "only.txt").write_text("one long document " * 500, encoding="utf-8")
    cfg = DataConfig(source=f"dir:{tmp_path}", seq_len=8, batch_size=2)
    with pytest.raises(DataError, match="no document of 1 fell in the eval split"):
        TokenDataset.build(cfg, vocab_size=257, seed=0, data_dir=tmp_path / "cache")


def test_byte_tokenizer_needs_257_ids(tmp_path: Path):
    _jsonl_corpus(tmp_path / "corpus")
    cfg = DataConfig(source=f"dir:{tmp_path / 'corpus'}", seq_len=8, batch_size=2, eval_fraction=0.3)
    with pytest.raises(DataError, match="more than the model vocab 256"):
        TokenDataset.build(cfg, vocab_size=256, seed=0, data_dir=tmp_path)
