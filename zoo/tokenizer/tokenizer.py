"""`Tokenizer`: a checkpoint's tokenizer and chat template (`zoo.load_tokenizer` builds one)."""

import dataclasses
import functools
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from zoo.tokenizer import content
from zoo.tokenizer.content import SpecialInContent

_NO_TEMPLATE = (
    "{source} has no chat template (none in its GGUF metadata, tokenizer_config.json or "
    "chat_template.jinja); pass one: zoo.load_tokenizer(path, chat_template='file.jinja') "
    "(a file, or the template text itself)"
)
ENDOFTEXT = "<|endoftext|>"


@dataclasses.dataclass(frozen=True, kw_only=True, eq=False)
class Tokenizer:
    """A tokenizer (HF `tokenizers` does the encoding: byte-level BPE, SentencePiece-style BPE
    with byte fallback, any tokenizer.json) with its chat template.

    `encode` behaves like HF's `tokenizer.encode(text, add_special_tokens=False)`: every string in
    `special_tokens` (the checkpoint's added tokens and named special tokens) that appears in the
    text becomes its id, also inside message contents; no BOS/EOS is added, a chat template writes
    those itself. `apply_chat_template` is HF's `apply_chat_template(messages, tokenize=True)` with
    its defaults, tested against transformers token for token.

    Fields: `backend` (the `tokenizers.Tokenizer`, with `special_tokens` among its added tokens),
    `special_tokens` (string -> id), `named_tokens` (`bos_token`, `eos_token`, `unk_token`, ...
    -> string; templates see them as variables), `chat_template` (Jinja source or None),
    `eos_ids` (the checkpoint's own extra end ids: generation_config.json's eos_token_id, GGUF's
    eot/eom ids), `source` (where it came from, for messages). Equality is identity.

    Training's data path (data/) takes this or a `tiktoken.Encoding` alike: `name`, `n_vocab`,
    `eot_token` (the document separator), `encode_ordinary` and `encode_ordinary_batch` (special
    strings stay text) are tiktoken's names for the same things.
    """

    backend: Any  # tokenizers.Tokenizer (not imported here: `import zoo` must not need it)
    special_tokens: Mapping[str, int]
    named_tokens: Mapping[str, str]
    chat_template: str | None = None
    eos_ids: tuple[int, ...] = ()
    source: str = "this tokenizer"

    def __post_init__(self):
        vocab = self.backend.get_vocab(with_added_tokens=True)
        wrong = {t: i for t, i in self.special_tokens.items() if vocab.get(t) != i}
        if wrong:
            raise ValueError(f"special tokens {wrong} do not have these ids in the vocabulary")
        unnamed = {k: t for k, t in self.named_tokens.items() if t not in self.special_tokens}
        if unnamed:
            raise ValueError(f"named tokens {unnamed} are not in special_tokens")

    @functools.cached_property
    def vocab_size(self) -> int:
        """One more than the largest id (pieces and added tokens)."""
        return max(self.backend.get_vocab(with_added_tokens=True).values()) + 1

    @property
    def n_vocab(self) -> int:
        return self.vocab_size

    @property
    def name(self) -> str:
        return self.source

    def _named_id(self, name: str) -> int | None:
        token = self.named_tokens.get(name)
        return None if token is None else self.special_tokens[token]

    @property
    def bos_token_id(self) -> int | None:
        return self._named_id("bos_token")

    @property
    def eos_token_id(self) -> int | None:
        return self._named_id("eos_token")

    @property
    def eot_token(self) -> int:
        """The document separator training packs between documents: `<|endoftext|>` where the
        vocabulary has it, else eos."""
        if ENDOFTEXT in self.special_tokens:
            return self.special_tokens[ENDOFTEXT]
        if self.eos_token_id is None:
            raise ValueError(
                f"{self.source} has neither {ENDOFTEXT} nor an eos token to separate documents"
            )
        return self.eos_token_id

    def encode(self, text: str, *, add_special_tokens: bool = False) -> list[int]:
        """The ids of `text`; special-token strings in it become their ids, and bytes the
        vocabulary has no token for are dropped or fall back to byte tokens (both as in HF).
        `add_special_tokens`: the tokenizer's own post-processing too (a BOS where it adds one),
        as HF's `tokenizer(text)` for a prompt without a chat template."""
        return self.backend.encode(text, add_special_tokens=add_special_tokens).ids

    def encode_with_offsets(self, text: str) -> tuple[list[int], list[tuple[int, int]]]:
        """`encode(text)` and each token's [start, stop) character span in `text`."""
        encoding = self.backend.encode(text, add_special_tokens=False)
        return encoding.ids, encoding.offsets

    @functools.cached_property
    def _ordinary(self):
        """A copy of the backend that encodes special-token strings as text."""
        from tokenizers import Tokenizer as Backend

        copy = Backend.from_str(self.backend.to_str())
        copy.encode_special_tokens = True
        return copy

    def encode_ordinary(self, text: str) -> list[int]:
        """The ids of `text` with special-token strings encoded as text (tiktoken's
        `encode_ordinary`: documents of a training corpus)."""
        return self._ordinary.encode(text, add_special_tokens=False).ids

    def encode_ordinary_batch(self, texts: Sequence[str]) -> list[list[int]]:
        return [e.ids for e in self._ordinary.encode_batch(list(texts), add_special_tokens=False)]

    def decode(self, ids: Iterable[int]) -> str:
        """The text of `ids` (special tokens included; bytes that are not valid UTF-8 become
        U+FFFD, as in HF)."""
        ids = [int(i) for i in ids]
        bad = [i for i in ids if not 0 <= i < self.vocab_size]
        if bad:
            raise ValueError(
                f"token ids {bad[:5]} are outside the vocabulary [0, {self.vocab_size})"
            )
        return self.backend.decode(ids, skip_special_tokens=False)

    def _template(self) -> str:
        if self.chat_template is None:
            raise ValueError(_NO_TEMPLATE.format(source=self.source))
        return self.chat_template

    def render_chat(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        add_generation_prompt: bool = False,
        **variables: Any,
    ) -> str:
        """The chat template's text for `messages` (a list of `{'role': ..., 'content': str}`;
        roles: system, user, assistant, tool and any other the template names). With
        `add_generation_prompt`, the text ends with the header of an assistant turn, ready for
        generation. `variables` are extra template variables, as HF's `**kwargs` (`tools=[...]`,
        `enable_thinking=False`); they override the named special tokens."""
        # Imported here: jinja2 is needed only by those who chat, not to encode.
        from zoo.tokenizer import chat

        return chat.render(
            self._template(),
            messages,
            add_generation_prompt=add_generation_prompt,
            variables={**self.named_tokens, **variables},
        )

    def apply_chat_template(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        add_generation_prompt: bool = False,
        special_in_content: SpecialInContent = "keep",
        **variables: Any,
    ) -> list[int]:
        """The ids of `render_chat(messages, ...)`: HF's `apply_chat_template` (tokenize=True).

        `special_in_content`: what a special token's string inside a message becomes
        (zoo/tokenizer/content.py). "keep" (the default, as transformers): the token, so a
        message can open turns of its own; "refuse": a ValueError naming the message and the
        token; "text": plain text, the template's own markers staying special tokens (the ids
        of "keep" wherever no message holds such a string). Text from untrusted users (a
        server, a chat) wants "text" or "refuse"."""
        mode = content.check_mode(special_in_content)

        def render(messages) -> str:
            return self.render_chat(
                messages, add_generation_prompt=add_generation_prompt, **variables
            )

        if mode == "text":
            return content.encode_as_text(self, messages, render)
        text = render(messages)  # checks the messages first
        if mode == "refuse":
            content.refuse(self, messages)
        return self.encode(text)

    @functools.cached_property
    def _raw_special_strings(self) -> tuple[str, ...] | None:
        """`special_in_content`'s quick test for special strings (zoo/tokenizer/content.py)."""
        return content.raw_special_strings(self)

    @functools.cached_property
    def _sentinel_backend(self) -> tuple[Any, dict[int, int]]:
        """`special_in_content="text"`'s copy of the backend (zoo/tokenizer/content.py)."""
        return content.sentinel_backend(self)

    @functools.cached_property
    def end_of_turn_ids(self) -> tuple[int, ...]:
        """The ids that end an assistant turn, first seen first: (1) the special token the chat
        template writes right after an assistant message's text (`<|im_end|>` for ChatML,
        `<|eot_id|>` for Llama 3; found by rendering a user -> assistant probe conversation,
        absent without a template or when the template refuses the probe), (2) eos, (3)
        `eos_ids` (generation_config.json's eos_token_id, GGUF's eot/eom token ids)."""
        ids = []
        if self.chat_template is not None:
            from zoo.tokenizer import chat

            end = chat.turn_end(self.chat_template, self.named_tokens, self.special_tokens)
            if end is not None:
                ids.append(self.special_tokens[end])
        if self.eos_token_id is not None:
            ids.append(self.eos_token_id)
        return tuple(dict.fromkeys([*ids, *self.eos_ids]))

    def stop_ids(self) -> tuple[int, ...]:
        """The ids generation stops at by default (`stop_tokens=` of `infer.generate` and
        `Engine.submit`): the model's end of turn and end of sequence, `end_of_turn_ids`."""
        return self.end_of_turn_ids
