"""A run that pins its BPE (`data.tokenizer_sha256`) tokenises with the pinned copy in the data cache and
trains none; a BPE trained here under a pin must hash to it; an unpinned run trains as before."""

import hashlib
import shutil
from pathlib import Path

import pytest

from hetnode.config import DataConfig
from hetnode.data import BpeTokenizer, TokenDataset
from hetnode.data.pinned_tokenizer import TokenizerMismatch, adopt, fetch_target, pinned_path
from hetnode.data.prepared import prepare_tokens
from hetnode.errors import DataError


@pytest.fixture
def text_cfg(tmp_path: Path, corpus, make_jsonl) -> DataConfig:
    """A BPE run over a .jsonl text source, unpinned; its data cache is tmp_path/cache."""
    make_jsonl(tmp_path / "texts" / "docs.jsonl", corpus)
    return DataConfig(
        source=f"dir:{tmp_path / 'texts'}",
        tokenizer="bpe",
        bpe_vocab_size=300,
        seq_len=31,
        batch_size=2,
        eval_fraction=0.2,
        data_dir=str(tmp_path / "cache"),
    )


@pytest.fixture
def run_tokenizer() -> tuple[str, str]:
    """(the run's tokenizer JSON, its sha256): a BPE learnt from other texts than the peer's."""
    texts = [f"the coordinator's corpus, line {i}: rivers, bridges and trains." for i in range(60)]
    text = BpeTokenizer.train(texts, 290, "run").to_json()
    return text, hashlib.sha256(text.encode()).hexdigest()


def build(cfg: DataConfig) -> TokenDataset:
    return TokenDataset.build(cfg, vocab_size=320, seed=0, data_dir=Path(cfg.data_dir))


def test_a_pinned_copy_in_the_cache_is_used_and_no_bpe_is_trained(text_cfg, run_tokenizer):
    text, sha = run_tokenizer
    cache = Path(text_cfg.data_dir)
    pinned = DataConfig(**{**text_cfg.__dict__, "tokenizer_sha256": sha})
    assert fetch_target(pinned, cache) == pinned_path(cache, sha)  # nothing here yet: fetch it
    pinned_path(cache, sha).parent.mkdir(parents=True)
    pinned_path(cache, sha).write_text(text, encoding="utf-8")
    assert fetch_target(pinned, cache) is None

    ds = build(pinned)
    assert isinstance(ds.tokenizer, BpeTokenizer) and ds.tokenizer.to_json() == text
    assert ds.tokenizer.vocab_size == 290  # the run's, not one of bpe_vocab_size 300 learnt here
    assert not list(cache.glob("bpe-*.json"))  # nothing trained
    assert build(pinned).tokenizer.to_json() == text  # the shards are reused, with the same tokenizer

    # unpinned, the same source trains its own BPE, into streams of its own
    own = build(text_cfg)
    assert own.tokenizer.to_json() != text and list(cache.glob("bpe-*.json"))


def test_a_trained_bpe_under_a_pin_must_be_the_pinned_one(text_cfg, run_tokenizer):
    _, sha = run_tokenizer
    with pytest.raises(DataError, match=f"sha256 [0-9a-f]{{64}}, not the run's data.tokenizer_sha256 {sha}"):
        build(DataConfig(**{**text_cfg.__dict__, "tokenizer_sha256": sha}))
    # the coordinator's case: what it trains is what it pinned
    trained = build(text_cfg).tokenizer
    assert isinstance(trained, BpeTokenizer)
    own_sha = hashlib.sha256(trained.to_json().encode()).hexdigest()
    assert build(DataConfig(**{**text_cfg.__dict__, "tokenizer_sha256": own_sha})).tokenizer.to_json() == (
        trained.to_json()
    )


def test_a_damaged_cached_copy_is_refused_and_fetched_again(text_cfg, run_tokenizer, tmp_path: Path):
    text, sha = run_tokenizer
    cache = Path(text_cfg.data_dir)
    pinned = DataConfig(**{**text_cfg.__dict__, "tokenizer_sha256": sha})
    path = pinned_path(cache, sha)
    path.parent.mkdir(parents=True)
    path.write_text(text + "\n", encoding="utf-8")  # one byte more: another hash
    with pytest.raises(DataError, match="damaged"):
        build(pinned)
    assert fetch_target(pinned, cache) == path

    # `adopt` takes a candidate only when it hashes to the pin, and renames it whole into place
    wrong = tmp_path / "wrong.part"
    wrong.write_text(text + " ", encoding="utf-8")
    with pytest.raises(TokenizerMismatch, match=f"not the run's data.tokenizer_sha256 {sha}") as refused:
        adopt(wrong, pinned, cache, "http://coordinator")
    assert refused.value.pinned == sha and refused.value.found != sha
    right = tmp_path / "right.part"
    right.write_text(text, encoding="utf-8")
    assert adopt(right, pinned, cache, "http://coordinator") == path and not right.exists()
    assert build(pinned).tokenizer.to_json() == text


def test_a_tokens_folder_without_its_tokenizer_takes_the_cached_pinned_copy(text_cfg, tmp_path: Path):
    out = tmp_path / "prepared"
    manifest = prepare_tokens(text_cfg, out, 40, Path(text_cfg.data_dir))
    sha = manifest["tokenizer"]["sha256"]
    folder_cfg = DataConfig(**{**text_cfg.__dict__, "source": f"tokens:{out}", "tokenizer_sha256": sha})
    cache = tmp_path / "peer-cache"
    folder_cfg = DataConfig(**{**folder_cfg.__dict__, "data_dir": str(cache)})
    assert fetch_target(folder_cfg, cache) is None  # the folder has its own: never replaced
    served = tmp_path / "served.json"
    shutil.move(out / "tokenizer.json", served)  # a copy of the shards alone
    assert fetch_target(folder_cfg, cache) == pinned_path(cache, sha)
    with pytest.raises(DataError, match="no copy of the run's tokenizer"):
        build(folder_cfg)
    adopt(served, folder_cfg, cache, "http://coordinator")
    ds = build(folder_cfg)
    assert (
        ds.tokenizer.name == manifest["tokenizer"]["name"] and ds.train_tokens == manifest["train"]["tokens"]
    )
    with pytest.raises(DataError, match="not the run's"):  # shards cut with another tokenizer: refused
        build(DataConfig(**{**folder_cfg.__dict__, "tokenizer_sha256": "0" * 64}))


def test_no_pin_or_the_byte_tokenizer_needs_nothing_fetched(text_cfg, tmp_path: Path):
    assert fetch_target(text_cfg, tmp_path) is None
    assert fetch_target(DataConfig(tokenizer_sha256="a" * 64), tmp_path) is None  # bytes: no file
