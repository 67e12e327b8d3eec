"""Conversations -> token ids with answer flags (`packing.Example`), for supervised fine-tuning.

With a chat template (a checkpoint's `zoo.Tokenizer`), a conversation is rendered by the template
itself (`Tokenizer.render_chat`) and encoded whole, exactly as `apply_chat_template` encodes it for
the model at inference. The answer spans are found with the template too, by rendering prefixes:
for the assistant message i, `render(messages[:i], add_generation_prompt=True)` ends with the
assistant header (`<|im_start|>assistant\\n` in ChatML) and `render(messages[:i + 1])` adds the
turn; the text between them, up to and including the end-of-turn token (`<|im_end|>`), is the
answer. Text after the end-of-turn token (ChatML's newline) is not. A token counts when it
overlaps an answer character, so every answer character is trained even where a BPE token
straddles the header's end. A template that does not render prefixes as prefixes of the whole
conversation (one that rewrites earlier turns) is refused with an error.

Without a chat template (a plain BPE: a trained one, an OpenAI encoding, or a checkpoint that has
none), a user + assistant pair (prompt/completion and alpaca data) is the prompt text followed by
the completion text, the loss on the completion only, with no end-of-turn token; a chat
conversation needs a template and is refused.
"""

import dataclasses
from collections.abc import Iterable, Iterator, Mapping, Sequence

import numpy as np
import tiktoken

from data.packing import Example
from zoo.tokenizer import Tokenizer, bpe

PAIR_ROLES = ("user", "assistant")  # the roles of a prompt/completion or alpaca example
_NEEDS_TEMPLATE = (
    "chat data (a 'messages' column) is rendered with the checkpoint's chat template, and "
    "{what} has none: fine-tune from a checkpoint that has one (--init-from an HF directory or "
    ".gguf with a chat template), or give prompt/completion data"
)


def has_template(tokenizer: Tokenizer | tiktoken.Encoding) -> bool:
    return isinstance(tokenizer, Tokenizer) and tokenizer.chat_template is not None


def check_tokenizer(tokenizer: Tokenizer | tiktoken.Encoding, data_format: str) -> None:
    """Chat data needs a chat template: a ValueError saying so, before any row is read."""
    if data_format == "chat" and not has_template(tokenizer):
        what = getattr(tokenizer, "source", None) or f"the tokenizer {tokenizer.name!r}"
        raise ValueError(_NEEDS_TEMPLATE.format(what=what))


def roles(tokenizer: Tokenizer | tiktoken.Encoding) -> tuple[str, ...]:
    """The roles a message may have: the chat template's, or a user + assistant pair without."""
    if has_template(tokenizer):
        from zoo.tokenizer import chat  # jinja2: needed only by those who chat

        return chat.template_roles(tokenizer.chat_template)
    return PAIR_ROLES


def _end_of_turn(tokenizer: Tokenizer) -> str | None:
    """The text of the token that ends an assistant turn (`<|im_end|>`), if the template has one."""
    ids = tokenizer.end_of_turn_ids
    return tokenizer.decode(ids[:1]) if ids else None


def answer_spans(tokenizer: Tokenizer, messages: Sequence[Mapping]) -> tuple[str, list[tuple]]:
    """The template's text of `messages` and the [start, stop) character spans of the assistant
    answers in it (see the module docstring)."""
    end = _end_of_turn(tokenizer)
    text, spans = "", []
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        head = tokenizer.render_chat(messages[:i], add_generation_prompt=True)
        turn = tokenizer.render_chat(messages[: i + 1])
        if not (head.startswith(text) and turn.startswith(head)):
            raise ValueError(
                f"the chat template of {tokenizer.source} renders the conversation up to message "
                f"{i} differently from its start plus the assistant header, so the answer spans "
                "cannot be found by rendering prefixes: use a template that renders each turn "
                "the same whatever follows"
            )
        stop = turn.rfind(end, len(head)) if end else -1
        spans.append((len(head), stop + len(end) if stop >= 0 else len(turn)))
        text = turn
    whole = tokenizer.render_chat(messages)
    if not whole.startswith(text):
        raise ValueError(
            f"the chat template of {tokenizer.source} renders the whole conversation differently "
            "from its prefixes: the answer spans cannot be found by rendering prefixes"
        )
    return whole, spans


def _token_flags(
    encoding: tiktoken.Encoding, ids: Sequence[int], text: str, spans: Iterable[tuple]
) -> np.ndarray:
    """Per token of `ids` (the encoding of `text`), whether it overlaps a character span."""
    raw = np.frombuffer(text.encode("utf-8", "surrogatepass"), np.uint8)
    inside = np.zeros(len(raw), bool)
    for start, stop in spans:
        first = len(text[:start].encode("utf-8", "surrogatepass"))
        inside[first : first + len(text[start:stop].encode("utf-8", "surrogatepass"))] = True
    sizes = np.array([len(encoding.decode_single_token_bytes(t)) for t in ids], np.int64)
    if sizes.sum() != len(raw):  # the tokenizer dropped bytes it has no token for (as HF does)
        absent = np.frombuffer(bpe.absent_bytes(encoding), np.uint8)
        inside = inside[~np.isin(raw, absent)]
    if sizes.sum() != len(inside):
        raise AssertionError("token bytes do not add up to the text's: a tokenizer bug")
    counts = np.concatenate([[0], np.cumsum(inside)])
    ends = np.cumsum(sizes)
    return counts[ends] > counts[ends - sizes]


def encode_example(
    tokenizer: Tokenizer | tiktoken.Encoding,
    messages: Sequence[Mapping[str, str]],
    *,
    last_answer_only: bool = False,
) -> Example:
    """`messages` as token ids with their answer flags (see the module docstring);
    `last_answer_only` flags the last assistant turn alone (a preference pair's response: the
    earlier turns are its prompt)."""
    if has_template(tokenizer):
        text, spans = answer_spans(tokenizer, messages)
        spans = spans[-1:] if last_answer_only else spans
        ids = tokenizer.encode(text)
        return Example(ids, _token_flags(tokenizer.encoding, ids, text, spans))
    if tuple(m["role"] for m in messages) != PAIR_ROLES:
        check_tokenizer(tokenizer, "chat")
    prompt, completion = (m["content"] for m in messages)
    text = prompt + completion
    if isinstance(tokenizer, Tokenizer):
        ids, encoding = tokenizer.encode(text), tokenizer.encoding
    else:
        ids, encoding = tokenizer.encode_ordinary(text), tokenizer
    return Example(ids, _token_flags(encoding, ids, text, [(len(prompt), len(text))]))


@dataclasses.dataclass
class Counts:
    """What `fit` did: examples kept, truncated, dropped (no answer token left after the cut),
    and the answer tokens and tokens of those kept."""

    examples: int = 0
    truncated: int = 0
    dropped: int = 0
    answer_tokens: int = 0
    tokens: int = 0

    def line(self) -> str:
        share = self.answer_tokens / max(self.tokens, 1)
        return (
            f"{self.examples:,} examples ({self.truncated:,} truncated to --seq-len, "
            f"{self.dropped:,} of them dropped: no answer token left); answer tokens counted "
            f"{self.answer_tokens:,} / "
            f"{self.tokens:,} tokens ({share:.1%})"
        )


def fit(
    examples: Iterable[tuple[int, Example]], seq_len: int, *, truncate: bool, counts: Counts
) -> Iterator[Example]:
    """The (row number, example) pairs as examples that fit a row of `seq_len` tokens (with the
    separator packing adds): a longer one is an error naming its row, or with `truncate` cut to
    `seq_len` tokens, and dropped if no answer token is left. Tallies into `counts`."""
    for number, example in examples:
        if len(example.ids) > seq_len:
            if not truncate:
                raise ValueError(
                    f"row {number} is {len(example.ids)} tokens long, more than --seq-len "
                    f"{seq_len}: pass --truncate to cut such examples (those left without an "
                    "answer token are dropped), or raise --seq-len"
                )
            example = Example(example.ids[:seq_len], example.answer[:seq_len])
            counts.truncated += 1
            if not np.any(example.answer):
                counts.dropped += 1
                continue
        counts.examples += 1
        counts.answer_tokens += int(np.sum(example.answer))
        counts.tokens += len(example.ids)
        yield example
