"""Log-probabilities in OpenAI's response shapes, from the engine's `TokenLogprob`s (the model's
raw log-softmax: before temperature, top-p and any output constraint; see `Engine.submit`).

- Chat (`logprobs: true`, `top_logprobs: k`): `{"content": [{"token", "logprob", "bytes",
  "top_logprobs": [{"token", "logprob", "bytes"}, ...k]}, ...], "refusal": null}`.
- Completions (`logprobs: k`): `{"tokens", "token_logprobs", "top_logprobs": [{token: logprob}
  of the k most likely and the chosen one], "text_offset"}`.

A token's text is its own decoding and `bytes` that text's UTF-8. A token holding part of a
character (it decodes to U+FFFD alone) is written as OpenAI writes one, `"bytes:\\xe2\\x80"`,
with its bytes read from the vocabulary (byte-level BPE pieces, SentencePiece's `<0xNN>` byte
tokens); so distinct byte tokens stay distinct keys in completions' top_logprobs. Where the
vocabulary does not say (neither kind), the text stays U+FFFD and `bytes` is null.
`text_offset` adds up the tokens' decoded lengths (as vLLM does), continued across streamed
chunks.
"""

import functools
import re
from collections.abc import Sequence

from infer.engine import TokenLogprob
from zoo.tokenizer import Tokenizer
from zoo.tokenizer.bpe import byte_decoder

_BYTE_TOKEN = re.compile(r"<0x([0-9A-Fa-f]{2})>")


class LogprobFormat:
    """Formats entries for the `tokenizer`'s tokens (each token's text worked out once)."""

    def __init__(self, tokenizer: Tokenizer):
        self.tokenizer = tokenizer
        self.token = functools.lru_cache(maxsize=1 << 16)(self._token)

    def _token(self, token: int) -> tuple[str, list[int] | None, int]:
        """A token's shown text, its bytes (None: unknown) and its decoded length."""
        text = self.tokenizer.decode([token])
        if "\ufffd" not in text:
            return text, list(text.encode()), len(text)
        piece = self.tokenizer.backend.id_to_token(token) or ""
        byte = _BYTE_TOKEN.fullmatch(piece)
        alphabet = byte_decoder()
        if byte:
            data = [int(byte.group(1), 16)]
        elif piece and all(c in alphabet for c in piece):
            data = [alphabet[c] for c in piece]
        else:
            return text, None, len(text)
        return "bytes:" + "".join(f"\\x{b:02x}" for b in data), data, len(text)

    def _one(self, token: int, logprob: float) -> dict:
        text, data, _ = self.token(token)
        return {"token": text, "logprob": logprob, "bytes": data}

    def length(self, entries: Sequence[TokenLogprob]) -> int:
        """The characters `entries` add to `text_offset`."""
        return sum(self.token(e.token)[2] for e in entries)

    def chat(self, entries: Sequence[TokenLogprob]) -> dict:
        content = [
            {**self._one(e.token, e.logprob), "top_logprobs": [self._one(*t) for t in e.top]}
            for e in entries
        ]
        return {"content": content, "refusal": None}

    def completion(self, entries: Sequence[TokenLogprob], offset: int = 0) -> dict:
        """`offset`: what the tokens before these (a stream's earlier chunks) add up to."""
        offsets = []
        for e in entries:
            offsets.append(offset)
            offset += self.token(e.token)[2]
        text = lambda token: self.token(token)[0]  # noqa: E731
        return {
            "tokens": [text(e.token) for e in entries],
            "token_logprobs": [e.logprob for e in entries],
            "top_logprobs": [
                {text(t): v for t, v in (*e.top, (e.token, e.logprob))} for e in entries
            ],
            "text_offset": offsets,
        }
