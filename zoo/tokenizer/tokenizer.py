"""`Tokenizer`: a checkpoint's tokenizer and chat template (`zoo.load_tokenizer` builds one)."""

import dataclasses
import functools
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import tiktoken

from zoo.tokenizer import bpe

_NO_TEMPLATE = (
    "{source} has no chat template (none in its GGUF metadata, tokenizer_config.json or "
    "chat_template.jinja); pass one: zoo.load_tokenizer(path, chat_template='file.jinja') "
    "(a file, or the template text itself)"
)


@dataclasses.dataclass(frozen=True, kw_only=True, eq=False)
class Tokenizer:
    """A byte-level BPE tokenizer (tiktoken does the encoding) with its chat template.

    `encode` behaves like HF's `tokenizer.encode(text, add_special_tokens=False)`: every string in
    `special_tokens` (the checkpoint's added tokens and named special tokens) that appears in the
    text becomes its id, also inside message contents; no BOS/EOS is added, a chat template writes
    those itself. `apply_chat_template` is HF's `apply_chat_template(messages, tokenize=True)` with
    its defaults, tested against transformers token for token.

    Fields: `encoding` (the tiktoken engine, with `special_tokens` as its special tokens),
    `special_tokens` (string -> id), `named_tokens` (`bos_token`, `eos_token`, `unk_token`, ...
    -> string; templates see them as variables), `chat_template` (Jinja source or None),
    `stop_ids` (the checkpoint's own extra end ids: generation_config.json's eos_token_id, GGUF's
    eot/eom ids), `source` (where it came from, for messages). Equality is identity.
    """

    encoding: tiktoken.Encoding
    special_tokens: Mapping[str, int]
    named_tokens: Mapping[str, str]
    chat_template: str | None = None
    stop_ids: tuple[int, ...] = ()
    source: str = "this tokenizer"

    def __post_init__(self):
        missing = set(self.special_tokens) - self.encoding.special_tokens_set
        if missing:
            raise ValueError(f"special tokens {sorted(missing)} are not special in the encoding")
        unnamed = {k: t for k, t in self.named_tokens.items() if t not in self.special_tokens}
        if unnamed:
            raise ValueError(f"named tokens {unnamed} are not in special_tokens")

    @property
    def vocab_size(self) -> int:
        """One more than the largest id (ranks and special tokens)."""
        return self.encoding.n_vocab

    def _named_id(self, name: str) -> int | None:
        token = self.named_tokens.get(name)
        return None if token is None else self.special_tokens[token]

    @property
    def bos_token_id(self) -> int | None:
        return self._named_id("bos_token")

    @property
    def eos_token_id(self) -> int | None:
        return self._named_id("eos_token")

    def encode(self, text: str) -> list[int]:
        """The ids of `text`; special-token strings in it become their ids, and bytes the
        vocabulary has no token for are dropped (both as in HF)."""
        if self._absent_bytes:
            raw = text.encode("utf-8", "surrogatepass")
            if len(raw.translate(None, self._absent_bytes)) != len(raw):
                return bpe.encode_dropping(self.encoding, text, self._absent_bytes)
        return self.encoding.encode(text, allowed_special="all")

    @functools.cached_property
    def _absent_bytes(self) -> bytes:
        return bpe.absent_bytes(self.encoding)

    def decode(self, ids: Iterable[int]) -> str:
        """The text of `ids` (bytes that are not valid UTF-8 become U+FFFD, as in HF)."""
        ids = [int(i) for i in ids]
        bad = [i for i in ids if not 0 <= i < self.vocab_size]
        if bad:
            raise ValueError(
                f"token ids {bad[:5]} are outside the vocabulary [0, {self.vocab_size})"
            )
        try:
            return self.encoding.decode(ids)
        except KeyError as e:
            raise ValueError(f"token id {e} is not in the vocabulary (a gap in its ids)") from e

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
        **variables: Any,
    ) -> list[int]:
        """The ids of `render_chat(messages, ...)`: HF's `apply_chat_template` (tokenize=True)."""
        return self.encode(
            self.render_chat(messages, add_generation_prompt=add_generation_prompt, **variables)
        )

    @functools.cached_property
    def end_of_turn_ids(self) -> tuple[int, ...]:
        """The ids that end an assistant turn, first seen first: (1) the special token the chat
        template writes right after an assistant message's text (`<|im_end|>` for ChatML,
        `<|eot_id|>` for Llama 3; found by rendering a user -> assistant probe conversation,
        absent without a template or when the template refuses the probe), (2) eos, (3)
        `stop_ids` (generation_config.json's eos_token_id, GGUF's eot/eom token ids)."""
        ids = []
        if self.chat_template is not None:
            from zoo.tokenizer import chat

            end = chat.turn_end(self.chat_template, self.named_tokens, self.special_tokens)
            if end is not None:
                ids.append(self.special_tokens[end])
        if self.eos_token_id is not None:
            ids.append(self.eos_token_id)
        return tuple(dict.fromkeys([*ids, *self.stop_ids]))
