"""The data layer: sources of text, tokenizers, and the deterministic per-slot batch schedule."""

from hetnode.data.dataset import TokenDataset, is_eval_key, split_documents
from hetnode.data.sources import Document, load_documents
from hetnode.data.tokenizer import BpeTokenizer, ByteTokenizer, Tokenizer, make_tokenizer

__all__ = [
    "BpeTokenizer",
    "ByteTokenizer",
    "Document",
    "TokenDataset",
    "Tokenizer",
    "is_eval_key",
    "load_documents",
    "make_tokenizer",
    "split_documents",
]
