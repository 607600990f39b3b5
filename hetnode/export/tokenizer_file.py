"""A BPE run's tokenizer from a `tokenizers` JSON file that may be anyone's: the one a coordinator serves
beside its checkpoints, or the `tokenizer.json` found beside a checkpoint folder.

The file is data: read within `MAX_TOKENIZER_BYTES`, parsed as strict UTF-8 JSON of bounded depth, and
taken only if it is a BPE with hetnode's end-of-text token and no more ids than the model it goes with.
A tokenizer pipeline is declarative (no code runs), so these checks are what it takes.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from tokenizers import Tokenizer as HfTokenizer

from hetnode.data.tokenizer import BpeTokenizer
from hetnode.errors import CheckpointError, DataError
from hetnode.replica.checkpoint import MAX_TOKENIZER_BYTES, TOKENIZER_FILE, list_checkpoints


def bpe_from_json(raw: bytes, where: str, model_vocab: int) -> BpeTokenizer:
    """The BPE tokenizer `raw` holds; CheckpointError unless a model of `model_vocab` ids can use it."""
    if len(raw) > MAX_TOKENIZER_BYTES:
        raise CheckpointError(f"{where}: {len(raw):,} bytes, more than a tokenizer file can be")
    try:
        text = raw.decode("utf-8")
        doc = json.loads(text)
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise CheckpointError(f"{where}: not a tokenizer JSON file ({type(exc).__name__})") from None
    model = doc.get("model") if isinstance(doc, dict) else None
    if not isinstance(model, dict) or model.get("type") != "BPE":
        raise CheckpointError(f"{where}: not a BPE tokenizer file")
    try:
        hf = HfTokenizer.from_str(text)
    except Exception as exc:  # the Rust side raises a bare Exception for a bad file
        raise CheckpointError(f"{where}: not a readable tokenizer file ({str(exc)[:200]})") from None
    name = f"bpe-{hashlib.sha256(raw).hexdigest()[:16]}"  # ours, not the sender's: it reaches the terminal
    try:
        tokenizer = BpeTokenizer(hf, name)
    except DataError as exc:
        raise CheckpointError(f"{where}: {exc}") from None
    if tokenizer.vocab_size > model_vocab:
        raise CheckpointError(
            f"{where}: a tokenizer of {tokenizer.vocab_size} ids, more than the model's {model_vocab}: "
            f"not this run's tokenizer"
        )
    return tokenizer


def tokenizer_beside(folder: Path, model_vocab: int) -> BpeTokenizer | None:
    """The `tokenizer.json` in a checkpoint folder, or beside it in a coordinator's folder of checkpoints
    (where the coordinator keeps it); None when there is none."""
    candidates = [folder / TOKENIZER_FILE]
    if folder in (found for _, found in list_checkpoints(folder.parent)):  # not any folder's neighbour
        candidates.append(folder.parent / TOKENIZER_FILE)
    for candidate in candidates:
        if candidate.is_file():
            with open(candidate, "rb") as f:
                raw = f.read(MAX_TOKENIZER_BYTES + 1)
            return bpe_from_json(raw, str(candidate), model_vocab)
    return None
