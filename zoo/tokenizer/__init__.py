"""Tokenizers with chat templates: `load_tokenizer(path)` reads a checkpoint's tokenizer (HF
directory, tokenizer.json, GGUF or tiktoken rank file) into a `Tokenizer`, which encodes with HF
`tokenizers` and renders the checkpoint's Jinja chat template as HF transformers does;
`save_tokenizer` writes one as an HF tokenizer. `bpe` holds the byte-level BPE pieces (byte
alphabet, pre-tokenizer regexes) that data/ reuses for the BPEs it trains, `sentencepiece` the
SentencePiece-style vocabularies of GGUF files."""

from zoo.tokenizer.load import from_tiktoken, load_tokenizer
from zoo.tokenizer.save import save_tokenizer
from zoo.tokenizer.tokenizer import Tokenizer

__all__ = ["Tokenizer", "from_tiktoken", "load_tokenizer", "save_tokenizer"]
