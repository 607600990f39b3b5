"""Tokenizers round-trip any text; the BPE trains locally, deterministically, and is reused from its cache."""

from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hetnode.config import DataConfig
from hetnode.data import BpeTokenizer, ByteTokenizer, Tokenizer, make_tokenizer
from hetnode.data.tokenizer import END_OF_TEXT, bpe_cache_path

SAMPLES = ["", "hello world", "héllo wörld — 日本語 🙂", "tabs\tand\nnewlines\r\n", "\x00nul", END_OF_TEXT]

WORDS_TEXT = "the a of to and in is was for on with as by at from river city music language science war"


def _corpus() -> list[str]:
    """A small deterministic corpus with repetition (so BPE has merges to learn) and some non-ASCII."""
    words_list = WORDS_TEXT.split()
    texts = []
    for i in range(120):
        words = [words_list[(i * 7 + j * 3) % len(words_list)] for j in range(12 + i % 5)]
        texts.append(" ".join(words).capitalize() + (" café naïve" if i % 4 == 0 else "") + ".")
    return texts


BPE_CFG = DataConfig(tokenizer="bpe", bpe_vocab_size=300)


@pytest.fixture(scope="module")
def bpe(tmp_path_factory: pytest.TempPathFactory) -> BpeTokenizer:
    tok = make_tokenizer(BPE_CFG, _corpus(), tmp_path_factory.mktemp("bpe"))
    assert isinstance(tok, BpeTokenizer)
    return tok


@pytest.mark.parametrize("text", SAMPLES)
def test_bytes_round_trip(text: str):
    tok = ByteTokenizer()
    ids = tok.encode(text)
    assert all(0 <= i < 256 for i in ids)
    assert tok.decode(ids) == text


def test_bytes_constants_and_protocol():
    tok = ByteTokenizer()
    assert (tok.name, tok.vocab_size, tok.eos_id) == ("bytes", 257, 256)
    assert isinstance(tok, Tokenizer)
    assert make_tokenizer(DataConfig(), [], Path("/nonexistent")).name == "bytes"  # no texts, no files needed


def test_bytes_decode_skips_eos_and_replaces_bad_utf8():
    tok = ByteTokenizer()
    assert tok.decode(tok.encode("ab") + [256] + tok.encode("cd")) == "abcd"
    assert tok.decode([0xFF, ord("x")]) == "\ufffdx"
    assert tok.decode([300, ord("y")]) == "y"  # a model with a larger vocab may sample ids past the bytes


@settings(max_examples=100, deadline=None)
@given(st.text())
def test_bytes_round_trip_property(text: str):
    tok = ByteTokenizer()
    assert tok.decode(tok.encode(text)) == text
    assert len(tok.encode(text)) == len(text.encode("utf-8"))


def test_bpe_learns_merges_and_round_trips(bpe: BpeTokenizer):
    assert 257 < bpe.vocab_size <= 300
    assert 0 <= bpe.eos_id < bpe.vocab_size
    assert isinstance(bpe, Tokenizer)
    for text in _corpus()[:10] + SAMPLES:
        ids = bpe.encode(text)
        assert all(0 <= i < bpe.vocab_size for i in ids)
        assert bpe.decode(ids) == text
    sentence = _corpus()[0]
    assert len(bpe.encode(sentence)) < 0.7 * len(sentence.encode("utf-8"))  # merges compress


def test_bpe_treats_end_of_text_in_a_document_as_text(bpe: BpeTokenizer):
    ids = bpe.encode(f"a{END_OF_TEXT}b")
    assert bpe.eos_id not in ids
    assert bpe.decode(ids + [bpe.eos_id] + bpe.encode("c")) == f"a{END_OF_TEXT}bc"


@settings(max_examples=100, deadline=None)
@given(st.text())
def test_bpe_round_trip_property(bpe: BpeTokenizer, text: str):
    assert bpe.decode(bpe.encode(text)) == text


def test_bpe_is_cached_and_reused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    texts = _corpus()
    first = make_tokenizer(BPE_CFG, texts, tmp_path)
    cache = bpe_cache_path(tmp_path, texts, 300)
    assert cache.is_file()
    assert first.name == cache.stem
    assert str(cache.stem).endswith("-v300")
    stamp = cache.stat().st_mtime_ns

    def no_training(*args: object, **kwargs: object) -> BpeTokenizer:
        raise AssertionError("the cached tokenizer should have been loaded")

    monkeypatch.setattr(BpeTokenizer, "train", no_training)
    second = make_tokenizer(BPE_CFG, texts, tmp_path)
    assert isinstance(second, BpeTokenizer)
    assert second.path == cache
    assert cache.stat().st_mtime_ns == stamp
    assert second.encode(texts[3]) == first.encode(texts[3])
    assert (second.vocab_size, second.eos_id, second.name) == (first.vocab_size, first.eos_id, first.name)


def test_bpe_cache_name_follows_corpus_and_vocab(tmp_path: Path):
    texts = _corpus()
    other = texts[:-1] + ["A different last document."]
    names = {
        bpe_cache_path(tmp_path, texts, 300).name,
        bpe_cache_path(tmp_path, other, 300).name,
        bpe_cache_path(tmp_path, texts, 400).name,
    }
    assert len(names) == 3
    make_tokenizer(BPE_CFG, other, tmp_path)  # a different corpus trains afresh, next to the first cache
    assert bpe_cache_path(tmp_path, other, 300).is_file()


def test_bpe_training_is_deterministic(tmp_path: Path):
    """Peers train their own BPE; they must all end up with the same vocabulary and merges."""
    a = make_tokenizer(BPE_CFG, _corpus(), tmp_path / "a")
    b = make_tokenizer(BPE_CFG, _corpus(), tmp_path / "b")
    assert isinstance(a, BpeTokenizer) and isinstance(b, BpeTokenizer)
    assert a.path is not None and b.path is not None
    assert a.path.read_text(encoding="utf-8") == b.path.read_text(encoding="utf-8")
