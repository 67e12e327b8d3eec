"""`TextStream`: a generation's tokens -> the text a client sees, piece by piece, with OpenAI's
`stop` strings matched on the decoded text (across token boundaries).

Each feed decodes the tokens so far and releases only text that is final: a trailing U+FFFD (a
character whose UTF-8 bytes are still arriving) and any tail that could be the start of a stop
string are held back until the next tokens settle them. The streamed pieces therefore
concatenate to exactly the text a non-streamed request returns.
"""

from collections.abc import Callable, Iterable, Sequence


class TextStream:
    """`feed(tokens) -> new text`; `stopped` once a stop string appeared (the text ends before
    it, and the stream ignores further tokens); `finish() -> the held-back rest` at the end.
    `hidden` ids (end-of-turn tokens) are counted but never shown."""

    def __init__(
        self,
        decode: Callable[[list[int]], str],
        *,
        stop: Sequence[str] = (),
        hidden: Iterable[int] = (),
    ):
        self.decode, self.stop, self.hidden = decode, tuple(s for s in stop if s), set(hidden)
        self.ids: list[int] = []
        self.shown = 0  # characters of the decoded text released so far
        self.stopped = False
        self.text = ""

    def _held(self, text: str) -> int:
        """How many trailing characters may still change or start a stop string."""
        partial = len(text) - len(text.rstrip("\ufffd"))
        prefix = max(
            (n for s in self.stop for n in range(1, len(s)) if text.endswith(s[:n])), default=0
        )
        return max(partial, prefix)

    def feed(self, tokens: Iterable[int]) -> str:
        if self.stopped:
            return ""
        self.ids.extend(t for t in tokens if t not in self.hidden)
        text = self.decode(self.ids)
        # A stop string may begin in text already released only within its length of the end.
        start = max(0, self.shown - max((len(s) for s in self.stop), default=0))
        hits = [i for i in (text.find(s, start) for s in self.stop) if i >= 0]
        if hits:
            self.stopped = True
            self.text = text[: min(hits)]
            return self._release(len(self.text))
        self.text = text
        return self._release(len(text) - self._held(text))

    def _release(self, end: int) -> str:
        piece = self.text[self.shown : max(end, self.shown)]
        self.shown += len(piece)
        return piece

    def finish(self) -> str:
        """The rest of the text (the generation ended: nothing held back can change now)."""
        return self._release(len(self.text))
