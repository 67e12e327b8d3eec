"""Data: tokenizers (tiktoken), datasets, packing."""
