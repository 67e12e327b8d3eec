"""Data: tokenizers (tiktoken), datasets loading, the stdlib corpus, packing, prefetch."""
