"""Special-token text inside chat messages: what `Tokenizer.apply_chat_template` does with a
message whose text holds a special token's string (`<|im_start|>`, `<|eot_id|>`, `</s>`).

transformers renders the template and encodes the whole text, so such a string in a user's
message becomes the real token: a user can close their turn and open a system or assistant turn
of their own. `SpecialInContent` chooses:

- "keep": transformers' behaviour (the library's default: ids equal to transformers');
- "refuse": a ValueError naming the message, the token and where it is;
- "text": the message's special-looking strings are encoded as plain text (as transformers'
  `split_special_tokens=True` would encode them), never as special ids, while the template's
  own markers stay special tokens. A conversation without such strings gets keep's ids exactly.

"Special" means the tokenizer's special tokens (`Tokenizer.special_tokens`: turn markers,
BOS/EOS); added tokens not marked special (Qwen's `<think>`, `<tool_call>`) are matched as
transformers matches them, in every mode. Every string of a message is checked (content, name,
tool-call fields); template variables passed by the caller (`tools=`) are the caller's and kept.

How "text" works: the template is rendered twice, once as given and once with each special
string inside the messages replaced by as many placeholder characters (a private-use character
absent from the text). Where the two texts agree, the template wrote the text; the special tokens
the tokenizer finds in the second text are the template's own markers. The first text is then
encoded by a copy of the tokenizer in which special tokens are plain text and each marker is
spelled by a sentinel added token of its own (same strip/normalisation flags), so the tokenizer
splits the text exactly where it splits it for the markers, and each sentinel becomes the
marker's id. A template whose output depends on the special strings in a message (one that
splits a message on `<|im_end|>`) cannot be rendered this way: a ValueError says so.
"""

import re
from collections.abc import Iterator, Mapping, Sequence
from typing import Any, Literal, get_args

SpecialInContent = Literal["keep", "refuse", "text"]
MODES: tuple[str, ...] = get_args(SpecialInContent)
# Sentinels: one character per special token from Unicode's Supplementary Private Use Area-A
# (no checkpoint vocabulary spells them; a text that holds one is refused in "text" mode).
_SENTINEL_BASE = 0xF0000
_PLACEHOLDERS = range(0xE000, 0xF900)  # the Basic Multilingual Plane's private use area


def check_mode(mode: Any) -> SpecialInContent:
    if mode not in MODES:
        raise ValueError(
            f"special_in_content must be one of {', '.join(map(repr, MODES))}, got {mode!r}"
        )
    return mode


def _strings(value: Any, where: str) -> Iterator[tuple[str, str]]:
    """(where, string) for every string inside a message (dict values and list items)."""
    if isinstance(value, str):
        yield where, value
    elif isinstance(value, Mapping):
        for key, item in value.items():
            yield from _strings(item, f"{where}[{key!r}]")
    elif isinstance(value, list | tuple):
        for i, item in enumerate(value):
            yield from _strings(item, f"{where}[{i}]")


def _replace_strings(value: Any, replace) -> Any:
    if isinstance(value, str):
        return replace(value)
    if isinstance(value, Mapping):
        return {key: _replace_strings(item, replace) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return type(value)(_replace_strings(item, replace) for item in value)
    return value


def raw_special_strings(tokenizer) -> tuple[str, ...] | None:
    """The special tokens' strings when each is matched on the raw text (none normalized
    first), so that a text holding none of them as a substring holds no special token; else
    None. The tokenizer keeps it (`Tokenizer._raw_special_strings`)."""
    added = tokenizer.backend.get_added_tokens_decoder()
    ids = tokenizer.special_tokens.values()
    return None if any(added[i].normalized for i in ids) else tuple(tokenizer.special_tokens)


def special_spans(tokenizer, text: str) -> list[tuple[int, int, int]]:
    """(start, stop, id) of each special token the tokenizer finds in `text` (as `encode`
    finds them: the tokenizers library's own matching)."""
    raw = tokenizer._raw_special_strings
    if raw is not None and not any(token in text for token in raw):
        return []  # the common case, found without encoding the text
    encoding = tokenizer.backend.encode(text, add_special_tokens=False)
    special = set(tokenizer.special_tokens.values())
    found = zip(encoding.ids, encoding.offsets, strict=True)
    return [(start, stop, i) for i, (start, stop) in found if i in special]


def refuse(tokenizer, messages: Sequence[Mapping[str, Any]]) -> None:
    """A ValueError for the first special token inside a message's strings."""
    names = {i: t for t, i in tokenizer.special_tokens.items()}
    for n, message in enumerate(messages):
        role = message.get("role") if isinstance(message, Mapping) else None
        for where, string in _strings(message, f"messages[{n}]"):
            spans = special_spans(tokenizer, string)
            if spans:
                start, _, token = spans[0]
                raise ValueError(
                    f"{where} ({role}) holds the special token {names[token]!r} at character "
                    f"{start}; encoded as transformers does, it would become a real "
                    f"{names[token]} token (a turn marker the user wrote), not text. Remove it, "
                    "or pass special_in_content='text' to encode it as plain text ('keep': "
                    "transformers' behaviour)"
                )


def _placeholder(*texts: str) -> str:
    used = set().union(*map(set, texts))
    for code in _PLACEHOLDERS:
        if chr(code) not in used:
            return chr(code)
    raise ValueError(  # only a text written to hold the whole private use area gets here
        "the messages use every private-use character U+E000-U+F8FF; special_in_content='text' "
        "needs one free: use 'refuse'"
    )


def _sentinel(k: int) -> str:
    return chr(_SENTINEL_BASE + k)


def sentinel_backend(tokenizer) -> tuple[Any, dict[int, int]]:
    """(a copy of `tokenizer.backend` that encodes special tokens as text and matches one
    sentinel added token per special token, sentinel id -> special id). The tokenizer keeps
    it (`Tokenizer._sentinel_backend`): a copy of the vocabulary takes a few tenths of a
    second."""
    from tokenizers import AddedToken
    from tokenizers import Tokenizer as Backend

    copy = Backend.from_str(tokenizer.backend.to_str())
    copy.encode_special_tokens = True
    added = tokenizer.backend.get_added_tokens_decoder()
    ids = sorted(tokenizer.special_tokens.values())
    copy.add_tokens(
        [
            AddedToken(
                _sentinel(k),
                special=False,
                single_word=added[i].single_word,
                lstrip=added[i].lstrip,
                rstrip=added[i].rstrip,
                normalized=added[i].normalized,
            )
            for k, i in enumerate(ids)
        ]
    )
    vocab = copy.get_vocab(with_added_tokens=True)
    return copy, {vocab[_sentinel(k)]: i for k, i in enumerate(ids)}


def encode_as_text(tokenizer, messages: Sequence[Mapping[str, Any]], render) -> list[int]:
    """The ids of `render(messages)` with the messages' special strings encoded as text (the
    module's docstring says how); `render` maps messages to the template's text."""
    text = render(messages)  # checks the messages too
    strings = [s for _, s in _strings(list(messages), "")]
    if not any(special_spans(tokenizer, s) for s in strings):
        return tokenizer.encode(text)  # nothing to tell apart: transformers' ids
    mark = _placeholder(text, *strings, *tokenizer.special_tokens)

    def defang(string: str) -> str:
        found = special_spans(tokenizer, string)
        for start, stop, _ in reversed(found):
            string = string[:start] + mark * (stop - start) + string[stop:]
        return string

    marked = render([_replace_strings(m, defang) for m in messages])
    written = re.finditer(f"[^{re.escape(mark)}]+", marked)  # what the template wrote itself
    agree = len(marked) == len(text) and all(
        text[m.start() : m.end()] == m.group() for m in written
    )
    if not agree:
        raise ValueError(
            "this chat template treats the special tokens inside the messages in a way of its "
            "own (its output changes with them, not only where they are), so they cannot be "
            "told apart from its markers: remove them, or pass special_in_content='refuse' "
            "(an error naming them) or 'keep' (transformers' behaviour)"
        )
    return encode_marked(tokenizer, text, marked)


def encode_marked(tokenizer, text: str, marked: str) -> list[int]:
    """The ids of `text` with special tokens only where the tokenizer finds them in `marked`
    (`text` with some characters replaced; the same length); elsewhere special strings are
    text. With `marked == text`, `encode(text)`'s ids."""
    used = range(_SENTINEL_BASE, _SENTINEL_BASE + len(tokenizer.special_tokens))
    stray = sorted({c for c in text if ord(c) in used})
    if stray:
        raise ValueError(
            f"the messages hold private-use characters {[f'U+{ord(c):X}' for c in stray[:3]]} "
            "(Supplementary Private Use Area-A), which special_in_content='text' uses "
            "internally: remove them, or use 'refuse'"
        )
    backend, special_of = tokenizer._sentinel_backend
    sentinel_of = {i: _sentinel(k) for k, i in enumerate(sorted(special_of.values()))}
    pieces, at = [], 0
    for start, stop, token in special_spans(tokenizer, marked):
        pieces += [text[at:start], sentinel_of[token]]
        at = stop
    pieces.append(text[at:])
    ids = backend.encode("".join(pieces), add_special_tokens=False).ids
    return [special_of.get(i, i) for i in ids]
