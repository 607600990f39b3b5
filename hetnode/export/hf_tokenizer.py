"""Tokenizer files that `AutoTokenizer.from_pretrained` loads as a `PreTrainedTokenizerFast` giving exactly
hetnode's ids: `tokenizer.json` (a `tokenizers` pipeline), `tokenizer_config.json`, `special_tokens_map.json`.

The byte tokenizer becomes a byte-level BPE with no merges whose vocabulary maps the GPT-2 byte alphabet
character of byte b to id b: the ByteLevel pre-tokenizer (no regex split, no prefix space) turns text into
one character per UTF-8 byte, so every byte is its own token, id = byte value, and the ByteLevel decoder
turns them back into bytes. End-of-text (256) is an added special token. The BPE tokenizer is already a
`tokenizers` JSON and is written as it is.

Neither adds BOS or EOS on encode (no post-processor). hetnode encodes the text "<|endoftext|>" as text, never
as the end-of-text id, so `split_special_tokens` is on: transformers then does the same.
"""

from __future__ import annotations

import json
from pathlib import Path

from tokenizers import AddedToken, decoders, models, pre_tokenizers
from tokenizers import Tokenizer as HfTokenizer

from hetnode.data.tokenizer import END_OF_TEXT, BpeTokenizer, ByteTokenizer, Tokenizer
from hetnode.errors import DataError

TOKENIZER = "tokenizer.json"


def byte_alphabet() -> dict[int, str]:
    """GPT-2's byte -> printable character map (the characters of `ByteLevel.alphabet()`): printable
    Latin-1 bytes stand for themselves, the other 68 bytes for U+0100.. in byte order."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars = {b: chr(b) for b in keep}
    extra = 0
    for b in range(256):
        if b not in chars:
            chars[b] = chr(256 + extra)
            extra += 1
    return chars


def byte_tokenizer_hf() -> HfTokenizer:
    """hetnode's `ByteTokenizer` as a `tokenizers` pipeline: ids 0..255 are bytes, 256 is end-of-text."""
    vocab = {char: b for b, char in byte_alphabet().items()}
    hf = HfTokenizer(models.BPE(vocab=vocab, merges=[]))
    hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    hf.decoder = decoders.ByteLevel()
    hf.add_special_tokens([AddedToken(END_OF_TEXT, special=True, normalized=False)])
    if hf.token_to_id(END_OF_TEXT) != ByteTokenizer.eos_id:
        raise AssertionError("the byte tokenizer's end-of-text must come right after the 256 bytes")
    return hf


def tokenizer_config(eos: str, max_len: int) -> dict[str, object]:
    return {
        # not LlamaTokenizer: that one adds BOS and builds its own SentencePiece-style pipeline
        "tokenizer_class": "PreTrainedTokenizerFast",
        "eos_token": eos,
        "pad_token": eos,
        "bos_token": None,
        "add_bos_token": False,
        "add_eos_token": False,
        "split_special_tokens": True,
        "clean_up_tokenization_spaces": False,  # would rewrite " ." into "." on decode
        "model_max_length": max_len,
    }


def write_tokenizer_files(out: Path, tokenizer: Tokenizer, max_len: int) -> list[Path]:
    """Write the three tokenizer files for `tokenizer` into `out`; the paths written."""
    if isinstance(tokenizer, ByteTokenizer):
        byte_tokenizer_hf().save(str(out / TOKENIZER))
    elif isinstance(tokenizer, BpeTokenizer):
        tokenizer.save(out / TOKENIZER)
    else:
        raise DataError(f"cannot export tokenizer {tokenizer!r}: only the byte and BPE tokenizers are known")
    written = [out / TOKENIZER]
    for name, doc in (
        ("tokenizer_config.json", tokenizer_config(END_OF_TEXT, max_len)),
        ("special_tokens_map.json", {"eos_token": END_OF_TEXT, "pad_token": END_OF_TEXT}),
    ):
        (out / name).write_text(json.dumps(doc, indent=2) + "\n", encoding="utf-8")
        written.append(out / name)
    return written
