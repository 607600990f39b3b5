"""The data layer: sources of text, tokenizers, and the deterministic per-slot batch schedule."""

from hetnode.data.dataset import TokenDataset
from hetnode.data.documents import Document, is_eval_key, split_documents
from hetnode.data.epochs import check_epochs, training_dataset
from hetnode.data.sources import iter_documents, load_documents
from hetnode.data.tokenizer import BpeTokenizer, ByteTokenizer, Tokenizer, make_tokenizer

__all__ = [
    "BpeTokenizer",
    "ByteTokenizer",
    "Document",
    "TokenDataset",
    "Tokenizer",
    "check_epochs",
    "is_eval_key",
    "iter_documents",
    "load_documents",
    "make_tokenizer",
    "split_documents",
    "training_dataset",
]
