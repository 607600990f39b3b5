"""The exported tokenizer files give hetnode's ids, in stock transformers and in bare `tokenizers`."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from tokenizers import Tokenizer as HfTokenizer
from tokenizers import pre_tokenizers

from hetnode.cli.main import main
from hetnode.config import replace
from hetnode.data.dataset import TokenDataset
from hetnode.data.tokenizer import BpeTokenizer, ByteTokenizer, Tokenizer
from hetnode.export.hf_tokenizer import byte_alphabet, write_tokenizer_files

transformers = pytest.importorskip("transformers")

TEXTS = [
    "Hello world.",
    "héllo wörld — naïve café",
    "emoji 🦙🚀 and 日本語 text",
    "line one\nline two\n\n\ttabbed",
    "  two leading spaces",
    "<|endoftext|> is text here",
    "",
    "Ω≈ç√∫˜µ≤≥÷ ¡™£¢∞§¶•ªº–≠",
    "\r\n windows line\r\n",
    "zero\x00byte and \x7f",
    "👩‍👩‍👧‍👦 family, 🇫🇷 flag",
    "a" * 300,
]


@pytest.fixture(params=["bytes", "bpe"])
def exported(request, bpe_path: Path, tmp_path: Path) -> tuple[Tokenizer, Path]:
    ours: Tokenizer = ByteTokenizer() if request.param == "bytes" else BpeTokenizer.load(bpe_path, "bpe-test")
    write_tokenizer_files(tmp_path, ours, max_len=64)
    return ours, tmp_path


def test_auto_tokenizer_gives_our_ids(exported):
    ours, folder = exported
    theirs = transformers.AutoTokenizer.from_pretrained(folder)
    assert theirs.eos_token_id == ours.eos_id and theirs.bos_token_id is None
    for text in TEXTS:
        ids = theirs(text, add_special_tokens=True)["input_ids"]
        assert ids == ours.encode(text), text  # no BOS/EOS added, "<|endoftext|>" stays text
        assert theirs.decode(ids) == text == ours.decode(ids)


def test_bare_tokenizers_library_gives_our_ids(exported):
    """Without transformers: `tokenizers` alone, told (as transformers is) to read special tokens as text."""
    ours, folder = exported
    bare = HfTokenizer.from_file(str(folder / "tokenizer.json"))
    bare.encode_special_tokens = True
    for text in TEXTS:
        assert bare.encode(text).ids == ours.encode(text), text
    assert bare.token_to_id("<|endoftext|>") == ours.eos_id


def test_byte_tokenizer_vocabulary_is_the_byte_values(tmp_path: Path):
    write_tokenizer_files(tmp_path, ByteTokenizer(), max_len=64)
    vocab = HfTokenizer.from_file(str(tmp_path / "tokenizer.json")).get_vocab()
    alphabet = byte_alphabet()
    assert set(alphabet.values()) == set(pre_tokenizers.ByteLevel.alphabet())
    assert {alphabet[b]: b for b in range(256)} | {"<|endoftext|>": 256} == vocab


def test_eos_decodes_as_the_special_token(exported):
    ours, folder = exported
    theirs = transformers.AutoTokenizer.from_pretrained(folder)
    ids = [*ours.encode("hi"), ours.eos_id]
    assert theirs.decode(ids, skip_special_tokens=True) == "hi" == ours.decode(ids)
    assert theirs.decode(ids).endswith("<|endoftext|>")


def test_a_bpe_run_without_tokenizer_flag_rebuilds_the_runs_tokenizer(
    small, write_checkpoint, tmp_path: Path
):
    """No --tokenizer: the BPE is rebuilt from the run's data config by the code peers train with."""
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    lines = [
        json.dumps({"text": f"document {i}: the river runs north to the old city {i % 7}"})
        for i in range(300)
    ]
    (corpus / "docs.jsonl").write_text("\n".join(lines) + "\n")
    config = replace(
        small("none", tied=False, tokenizer="bpe"),
        "data",
        source=f"dir:{corpus}",
        data_dir=str(tmp_path / "data-dir"),
        seq_len=16,
        batch_size=2,
        eval_fraction=0.2,
    )
    out = tmp_path / "hf"
    assert main(["export", "--from", str(write_checkpoint(config)), "--out", str(out)]) == 0
    peers = TokenDataset.build(config.data, config.model.vocab_size, config.run.seed).tokenizer
    theirs = transformers.AutoTokenizer.from_pretrained(out)
    text = "the river runs north: document 12 ü"
    assert theirs(text)["input_ids"] == peers.encode(text)
    assert len(peers.encode(text)) < len(text.encode())  # merges: a BPE, not bytes
