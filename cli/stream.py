"""One reply streamed out of an engine: new tokens decoded as they come, printed whole characters
at a time, and the reply ended where the model says stop (its end-of-turn and end-of-sequence
ids, `Tokenizer.stop_ids()`) or where the text reaches a stop string.

A stop string ends its request through the engine's own rule for callbacks: an `on_tokens` that
raises finishes its request (and only it), so the reply stops at once and its pages return to the
pool. `reply` tells that stop from a real failure.
"""

import dataclasses
from collections.abc import Callable, Sequence

import infer
from zoo import Tokenizer


class StopText(Exception):
    """The reply reached one of its stop strings (not an error: how a stop string ends it)."""


@dataclasses.dataclass
class Reply:
    """What a reply generated: its `text` (up to a stop string, without the stop token), its
    `request` (tokens, timings) and why it stopped: "stop token", "stop text" or "length"."""

    text: str
    request: infer.Request
    stopped_by: str


class _Printer:
    """Decodes the reply so far and writes what is new: never half a character (U+FFFD at the
    end waits for the next token) nor the start of what may become a stop string."""

    def __init__(self, tokenizer: Tokenizer, stop_ids, stop_texts: Sequence[str], write):
        self.tokenizer, self.stop_ids, self.stop_texts = tokenizer, set(stop_ids), stop_texts
        self.write, self.tokens, self.shown, self.text = write, [], 0, ""

    def __call__(self, tokens: list[int]) -> None:
        self.tokens += [t for t in tokens if t not in self.stop_ids]
        text = self.tokenizer.decode(self.tokens)
        cut = min((i for s in self.stop_texts if (i := text.find(s)) >= 0), default=None)
        if cut is not None:
            self.text = text[:cut]
            self.write(self.text[self.shown :])
            raise StopText
        held = max((_overlap(text, s) for s in self.stop_texts), default=0)
        ready = text[: len(text) - held]
        if ready.endswith("\ufffd"):
            return
        self.write(ready[self.shown :])
        self.shown, self.text = len(ready), text

    def flush(self) -> None:
        self.text = self.tokenizer.decode(self.tokens)
        self.write(self.text[self.shown :])
        self.shown = len(self.text)


def _overlap(text: str, stop: str) -> int:
    """The length of the longest end of `text` that starts `stop`."""
    return next(
        (n for n in range(min(len(stop) - 1, len(text)), 0, -1) if stop.startswith(text[-n:])), 0
    )


def reply(
    engine: infer.Engine,
    tokenizer: Tokenizer,
    prompt: list[int],
    *,
    max_new_tokens: int,
    sampler: infer.Sampler | None,
    stop_texts: Sequence[str] = (),
    write: Callable[[str], object],
) -> Reply:
    """Generate a reply to `prompt` on `engine`, streamed to `write`, stopping at the
    tokenizer's stop ids, a stop text or `max_new_tokens`."""
    stop_ids = tokenizer.stop_ids()
    printer = _Printer(tokenizer, stop_ids, stop_texts, write)
    request = engine.submit(
        prompt, max_new_tokens=max_new_tokens, sampler=sampler, stop_tokens=stop_ids,
        on_tokens=printer,
    )  # fmt: skip
    engine.run()
    if isinstance(request.error, StopText):
        return Reply(printer.text, request, "stop text")
    if request.error is not None:
        raise request.error
    printer.flush()
    ended = bool(request.tokens) and request.tokens[-1] in set(stop_ids)
    return Reply(printer.text, request, "stop token" if ended else "length")
