"""Data input: tokenizers, packed batches of text files or record shards (records.py), synthetic batches."""

from maxpar.io.data.synthetic import synthetic_batches
from maxpar.io.data.text import document_batches, process_rows, resolve_files, split_files, text_batches
from maxpar.io.data.tokenizer import ByteTokenizer, Tokenizer, load_tokenizer

__all__ = [
    "ByteTokenizer",
    "document_batches",
    "Tokenizer",
    "load_tokenizer",
    "process_rows",
    "resolve_files",
    "split_files",
    "synthetic_batches",
    "text_batches",
]
