"""Tokenizers with chat templates: `load_tokenizer(path)` reads a checkpoint's byte-level BPE
(HF directory, tokenizer.json or GGUF) into a `Tokenizer`, which encodes with tiktoken and renders
the checkpoint's Jinja chat template as HF transformers does. `bpe` holds the byte-level BPE
pieces (byte alphabet, pre-tokenizer regexes) that data/ reuses for the BPEs it trains."""

from zoo.tokenizer.load import load_tokenizer
from zoo.tokenizer.tokenizer import Tokenizer

__all__ = ["Tokenizer", "load_tokenizer"]
