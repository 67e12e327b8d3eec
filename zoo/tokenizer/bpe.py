"""Byte-level BPE vocabularies (GPT-2, Llama 3, SmolLM2) as `tiktoken.Encoding`s, and the pieces
every byte-level BPE in the project shares: GPT-2's byte alphabet and the pre-tokenizer regexes.

tiktoken encodes by merging, inside each regex piece, the adjacent pair whose concatenation has
the lowest rank, and returns ranks as ids. An HF/GGUF BPE merges in the order of its merge list.
The two agree when ranks are the token ids and the ids grow with the merge order, which is how
these vocabularies are built; `build_encoding` checks it and refuses a vocabulary where it fails.
"""

import functools
import json

import regex
import tiktoken

# The pre-tokenizer regexes, in tiktoken's (fancy-regex) syntax.
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
# llama.cpp's names for the pre-tokenizers above (`tokenizer.ggml.pre`).
GGUF_PATTERNS = {"gpt2": GPT2_PATTERN, "smollm": DIGITS_PATTERN, "llama-bpe": LLAMA3_PATTERN}


@functools.cache
def byte_decoder() -> dict[str, int]:
    """GPT-2's printable stand-in character for each byte, inverted (Radford et al. 2019): the
    alphabet in which byte-level BPE vocabularies write their tokens."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    return {c: b for b, c in chars.items()}


def token_bytes(token: str) -> bytes:
    """The bytes a byte-level BPE token stands for (`"Ġhi"` -> `b" hi"`)."""
    decoder = byte_decoder()
    try:
        return bytes(decoder[c] for c in token)
    except KeyError as e:
        raise ValueError(
            f"token {token!r} is not byte-level BPE (character {e} has no byte); only GPT-2 style "
            "byte-level vocabularies convert to tiktoken"
        ) from e


def _merge(merge: str | list[str]) -> tuple[str, str]:
    a, b = merge.split(" ", 1) if isinstance(merge, str) else merge
    return a, b


def build_encoding(
    name: str,
    *,
    vocab: dict[str, int],
    merges: list,
    added: dict[str, int],
    special: dict[str, int],
    pat_str: str,
) -> tiktoken.Encoding:
    """tiktoken encoding from a byte-level BPE's vocab (piece -> id) and merge list.

    `added` are the tokens outside the BPE (HF's added tokens, GGUF's control and user-defined
    tokens): they leave the ranks, so merges can never produce them. `special` are the strings
    matched whole in any text before the BPE runs, as HF matches added tokens and the named
    special tokens: `added` plus, for example, an eos token the vocabulary also holds as an
    ordinary piece (which stays a rank too, as it stays in HF's BPE model).
    """
    ranks = {token_bytes(t): i for t, i in vocab.items() if t not in added}
    previous = -1
    for merge in merges:
        a, b = _merge(merge)
        merged = vocab.get(a + b)
        if merged is None or merged <= previous:
            raise ValueError(
                f"merge {a!r} + {b!r} (-> id {merged}) breaks the rule that ids grow with merge "
                "order, so tiktoken's rank-based BPE would tokenize differently; not convertible"
            )
        previous = merged
    return tiktoken.Encoding(name, pat_str=pat_str, mergeable_ranks=ranks, special_tokens=special)


def pattern_from_hf(pre: dict | None) -> str:
    """tiktoken regex equal to an HF tokenizer.json pre_tokenizer (the byte-level ones)."""
    steps = (pre or {}).get("pretokenizers", [pre] if pre else [])
    kinds = [step["type"] for step in steps]
    byte_level = steps[-1] if kinds and kinds[-1] == "ByteLevel" else None
    if byte_level and byte_level.get("add_prefix_space"):
        raise ValueError("ByteLevel add_prefix_space=True is not supported by tiktoken encodings")
    if kinds == ["ByteLevel"] and byte_level.get("use_regex", True):
        return GPT2_PATTERN
    if kinds == ["Digits", "ByteLevel"] and steps[0].get("individual_digits"):
        return DIGITS_PATTERN
    if kinds == ["Split", "ByteLevel"] and not byte_level.get("use_regex", True):
        split = steps[0]
        if (
            split.get("behavior") == "Isolated"
            and not split.get("invert")
            and "Regex" in split.get("pattern", {})
        ):
            return split["pattern"]["Regex"]
    raise ValueError(
        f"pre_tokenizer {json.dumps(pre)} is not supported; the converter knows ByteLevel (GPT-2), "
        "Digits + ByteLevel (SmolLM2) and Split(regex) + ByteLevel (Llama 3)"
    )


def absent_bytes(encoding: tiktoken.Encoding) -> bytes:
    """The single bytes the vocabulary has no token for. Byte-level BPEs trained from text can
    lack bytes that never occurred: SmolLM2 lacks 21 (control bytes such as 0x04, and 0xF1/0xF2,
    the lead bytes of planes 4-11)."""
    absent = []
    for b in range(256):
        try:
            encoding.encode_single_token(bytes([b]))
        except KeyError:
            absent.append(b)
    return bytes(absent)


def encode_dropping(encoding: tiktoken.Encoding, text: str, absent: bytes) -> list[int]:
    """`encoding.encode(text, allowed_special="all")` for a text holding bytes the vocabulary
    lacks (`absent`), as HF's BPE without an unknown token encodes it: such bytes are dropped from
    each pre-token and the rest is merged as usual. tiktoken itself panics on them.

    Splits the text as tiktoken does (special tokens, then the pre-tokenizer regex, run by the
    `regex` module as tiktoken's own pure-Python reference does) and runs tiktoken's BPE on each
    piece's remaining bytes. Slower than `encode`: only for texts that need it.
    """
    specials = sorted(encoding.special_tokens_set, key=len, reverse=True)
    parts = regex.split(f"({'|'.join(map(regex.escape, specials))})", text) if specials else [text]
    pieces = regex.compile(encoding._pat_str)  # tiktoken keeps the pattern private
    ids = []
    for i, part in enumerate(parts):
        if i % 2:  # the split's captured separators: special tokens
            ids.append(encoding.encode_single_token(part))
            continue
        for piece in pieces.findall(part):
            kept = piece.encode("utf-8", "surrogatepass").translate(None, absent)
            if kept:  # tiktoken panics on an empty piece
                ids += encoding._encode_single_piece(kept)
    return ids
