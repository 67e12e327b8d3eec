"""Byte-level BPE (GPT-2, Llama 3, Qwen, SmolLM2) as HF `tokenizers` objects: GPT-2's byte
alphabet, the pre-tokenizer regexes llama.cpp names, the pipeline of a byte-level vocabulary, and
the conversion of tiktoken ranks (a BPE train.py trained, an OpenAI encoding) to vocabulary and
merges.

`tokenizers` is imported inside the functions: `import zoo` must not need it (it is a
training/tokenizing dependency, absent from some inference machines).
"""

import functools

# The pre-tokenizer regexes (the fancy-regex syntax of tiktoken and `tokenizers` alike).
# GPT-2's split: contractions, letters, digits, punctuation runs, whitespace runs.
GPT2_PATTERN = r"""'(?:[sdmt]|ll|ve|re)| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
# HF's Sequence[Digits(individual_digits), ByteLevel] (SmolLM2; llama.cpp's "smollm") as one
# regex: every digit is its own piece, so no piece spans a digit boundary (no " 1", and a run of
# spaces before a digit is not split to give the digit a leading space).
DIGITS_PATTERN = r"""'(?:[sdmt]|ll|ve|re)| ?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+|\s+(?![^\s\p{N}])|\s+"""
LLAMA3_PATTERN = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"""
    r"""| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""
)
# Qwen2/2.5/3 (transformers' PRETOKENIZE_REGEX of Qwen2Tokenizer): Llama 3's with single digits.
QWEN2_PATTERN = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"""
    r"""|\s*[\r\n]+|\s+(?!\S)|\s+"""
)
# llama.cpp's names for the pre-tokenizers above (`tokenizer.ggml.pre`).
GGUF_PATTERNS = {
    "default": GPT2_PATTERN,
    "gpt2": GPT2_PATTERN,
    "smollm": DIGITS_PATTERN,
    "llama-bpe": LLAMA3_PATTERN,
    "llama3": LLAMA3_PATTERN,
    "qwen2": QWEN2_PATTERN,
}


@functools.cache
def byte_encoder() -> dict[int, str]:
    """GPT-2's printable stand-in character for each byte (Radford et al. 2019): the alphabet in
    which byte-level BPE vocabularies write their tokens."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    return chars


@functools.cache
def byte_decoder() -> dict[str, int]:
    """`byte_encoder` inverted: stand-in character -> byte."""
    return {c: b for b, c in byte_encoder().items()}


def spell(token: bytes) -> str:
    """A token's bytes in the byte-level alphabet (`b" hi"` -> `"Ġhi"`)."""
    encoder = byte_encoder()
    return "".join(encoder[b] for b in token)


def byte_level(vocab: dict[str, int], merges: list, pattern: str):
    """A `tokenizers.Tokenizer` of a byte-level BPE: `vocab` (spelled piece -> id) and `merges`
    (pairs, or "a b" strings, in merge order), text split by `pattern` then mapped to the byte
    alphabet, decoded back to bytes. Special tokens are added by the caller."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

    pairs = [tuple(m.split(" ", 1)) if isinstance(m, str) else tuple(m) for m in merges]
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=pairs, fuse_unk=False))
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(pattern), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tokenizer.decoder = decoders.ByteLevel()
    return tokenizer


def _parts(ranks: dict[bytes, int], token: bytes, below: int) -> list[bytes]:
    """`token` split by BPE with the merges ranked below `below` (tiktoken's algorithm)."""
    parts = [bytes([b]) for b in token]
    while len(parts) > 1:
        scored = [
            (rank, i)
            for i in range(len(parts) - 1)
            if (rank := ranks.get(parts[i] + parts[i + 1])) is not None and rank < below
        ]
        if not scored:
            break
        _, i = min(scored)
        parts[i : i + 2] = [parts[i] + parts[i + 1]]
    return parts


def from_ranks(ranks: dict[bytes, int], pattern: str) -> tuple[dict[str, int], list[tuple]]:
    """(vocab, merges) of the byte-level BPE that tiktoken's `ranks` (token bytes -> rank) encode
    with: each multi-byte token is the merge of the two parts BPE leaves it in with the merges
    ranked before it (as transformers converts tiktoken files). A rank table that is no BPE (a
    token that no single merge makes) is refused."""
    vocab = {spell(token): rank for token, rank in ranks.items()}
    merges = []
    for token, rank in sorted(ranks.items(), key=lambda item: item[1]):
        if len(token) == 1:
            continue
        parts = _parts(ranks, token, rank)
        if len(parts) != 2:
            raise ValueError(
                f"tiktoken rank {rank} ({token!r}) is not made by one merge of earlier tokens "
                f"(BPE leaves {len(parts)} parts): these ranks are no byte-level BPE"
            )
        merges.append((spell(parts[0]), spell(parts[1])))
    return vocab, merges
