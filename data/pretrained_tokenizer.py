"""The tokenizer that comes with a checkpoint as a `tiktoken.Encoding`: an HF tokenizer.json or
the tokenizer metadata of a GGUF file, for byte-level BPE vocabularies (GPT-2, Llama 3, SmolLM2).

tiktoken encodes by merging, inside each regex piece, the adjacent pair whose concatenation has
the lowest rank, and returns ranks as ids. An HF/GGUF BPE merges in the order of its merge list.
The two agree when ranks are the token ids and the ids grow with the merge order, which is how
these vocabularies are built; the converter checks it and refuses a vocabulary where it fails.
Added tokens (and the chat template's `<|...|>` role markers) become special tokens.
"""

import functools
import json
import os
import re

import tiktoken

# The pre-tokenizer regexes, in tiktoken's (fancy-regex) syntax.
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
_GGUF_CONTROL, _GGUF_USER_DEFINED = 3, 4  # llama.cpp token types that are not BPE pieces
_ROLE_MARKER = re.compile(r"<\|[^|<>\s]+\|>")


@functools.cache
def _byte_decoder() -> dict[str, int]:
    """GPT-2's printable stand-in character for each byte, inverted (Radford et al. 2019)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    return {c: b for b, c in chars.items()}


def _token_bytes(token: str) -> bytes:
    decoder = _byte_decoder()
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
    special: dict[str, int],
    pat_str: str,
    chat_template: str | None,
) -> tiktoken.Encoding:
    """tiktoken encoding from a byte-level BPE's vocab (piece -> id), merge list and specials."""
    if chat_template:
        for marker in _ROLE_MARKER.findall(chat_template):
            if marker in vocab and marker not in special:
                special[marker] = vocab[marker]
    ranks = {_token_bytes(t): i for t, i in vocab.items() if t not in special}
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


def _pattern_from_hf(pre: dict | None) -> str:
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


def _from_tokenizer_json(path: str, chat_template: str | None) -> tiktoken.Encoding:
    with open(path) as f:
        spec = json.load(f)
    model = spec["model"]
    if model.get("type") != "BPE" or model.get("byte_fallback"):
        raise ValueError(
            f"{path}: model type {model.get('type')!r} (byte_fallback={model.get('byte_fallback')})"
            " is not byte-level BPE; only byte-level BPE converts to tiktoken"
        )
    if spec.get("normalizer") is not None:
        raise ValueError(f"{path}: a normalizer ({spec['normalizer']['type']}) is not supported")
    special = {t["content"]: t["id"] for t in spec.get("added_tokens", [])}
    return build_encoding(
        os.path.basename(os.path.dirname(os.path.abspath(path))),
        vocab=model["vocab"],
        merges=model["merges"],
        special=special,
        pat_str=_pattern_from_hf(spec.get("pre_tokenizer")),
        chat_template=chat_template,
    )


def _from_gguf(path: str) -> tiktoken.Encoding:
    from zoo.pretrained.gguf import metadata, open_gguf

    reader = open_gguf(path)
    kind = metadata(reader, "tokenizer.ggml.model")
    if kind != "gpt2":
        raise ValueError(f"GGUF tokenizer model {kind!r} is not supported; only 'gpt2' (BPE)")
    pre = metadata(reader, "tokenizer.ggml.pre", "gpt2")
    if pre not in GGUF_PATTERNS:
        raise ValueError(
            f"GGUF pre-tokenizer {pre!r} is not supported; known: {', '.join(GGUF_PATTERNS)}"
        )
    tokens = metadata(reader, "tokenizer.ggml.tokens")
    types = metadata(reader, "tokenizer.ggml.token_type")
    not_bpe = (_GGUF_CONTROL, _GGUF_USER_DEFINED)
    special = {t: i for i, (t, k) in enumerate(zip(tokens, types, strict=True)) if k in not_bpe}
    return build_encoding(
        os.path.basename(path).removesuffix(".gguf"),
        vocab={t: i for i, t in enumerate(tokens)},
        merges=metadata(reader, "tokenizer.ggml.merges"),
        special=special,
        pat_str=GGUF_PATTERNS[pre],
        chat_template=metadata(reader, "tokenizer.chat_template", ""),
    )


def tokenizer_from_pretrained(path: str | os.PathLike) -> tiktoken.Encoding:
    """The tokenizer of a checkpoint: an HF directory (tokenizer.json, plus the chat template of
    tokenizer_config.json), a tokenizer.json file, or a .gguf file (its tokenizer metadata)."""
    path = os.fspath(path)
    if path.endswith(".gguf"):
        return _from_gguf(path)
    if os.path.isdir(path):
        config = os.path.join(path, "tokenizer_config.json")
        template = None
        if os.path.isfile(config):
            with open(config) as f:
                template = json.load(f).get("chat_template")
        path = os.path.join(path, "tokenizer.json")
        if not os.path.isfile(path):
            raise ValueError(f"{os.path.dirname(path)!r} has no tokenizer.json")
        return _from_tokenizer_json(path, template if isinstance(template, str) else None)
    if os.path.isfile(path) and path.endswith(".json"):
        return _from_tokenizer_json(path, None)
    raise ValueError(
        f"{path!r} is not a tokenizer: pass an HF directory, a tokenizer.json or a .gguf file"
    )
