"""One HTTP request's generation: its choices as engine requests (through `EngineThread`), their
tokens turned into text pieces (`TextStream`: stop strings, held-back partial characters) and a
finish reason each. Both endpoints, streamed or not, read the same pieces."""

import asyncio
import dataclasses
import secrets
from collections.abc import AsyncIterator, Awaitable, Callable

from infer.engine import TokenLogprob
from infer.sampling import Greedy, Sampler, Temperature, TopP
from infer.serve.grammar import Grammars
from infer.serve.protocol import Sampling
from infer.serve.text import TextStream
from infer.serve.worker import Choice, EngineThread, Finished, Tokens
from zoo.tokenizer import Tokenizer


class BadRequest(ValueError):
    """A request the server refuses (400), with what to change."""


class GenerationFailed(RuntimeError):
    """A choice ended with an error inside the engine (its grammar, the step)."""


class Disconnected(Exception):
    """The client went away."""


@dataclasses.dataclass(frozen=True)
class Piece:
    """New text of choice `index`; `finish_reason` ("stop" or "length") on its last piece;
    with log-probabilities asked for, `logprobs` of the tokens that arrived with it (the
    shown ones: not the hidden end of turn; when a stop string ends the text, up to the token
    that completed it). Text held back (a partial character, a possible stop string) comes in
    a later piece than its tokens' entries."""

    index: int
    text: str
    finish_reason: str | None = None
    logprobs: tuple[TokenLogprob, ...] = ()


def sampler_of(body: Sampling) -> Sampler:
    if body.temperature == 0:
        return Greedy()
    if body.top_p < 1:
        return TopP(body.top_p, temperature=body.temperature)
    return Temperature(body.temperature)


class Generations:
    """What every generation shares: the engine's thread, the tokenizer, the end-of-turn ids
    (stop tokens of every request, hidden from the text) and, built when first needed, the
    grammars of structured output."""

    def __init__(self, worker: EngineThread, tokenizer: Tokenizer, *, max_n: int):
        self.worker, self.tokenizer, self.max_n = worker, tokenizer, max_n
        self.end_ids = tuple(tokenizer.end_of_turn_ids)
        self._grammars: Grammars | None = None

    @property
    def max_len(self) -> int:
        return self.worker.engine.max_len

    @property
    def grammars(self) -> Grammars:
        if self._grammars is None:
            vocab = self.worker.engine.model.config.vocab_size
            self._grammars = Grammars(self.tokenizer, vocab_size=vocab, end_ids=self.end_ids)
        return self._grammars

    def budget(self, prompt: list[int], max_tokens: int | None) -> int:
        """New tokens allowed: `max_tokens`, or what `max_len` leaves after the prompt."""
        if max_tokens is None:
            if len(prompt) >= self.max_len:
                raise BadRequest(
                    f"the prompt ({len(prompt)} tokens) leaves no room in the server's "
                    f"max_len={self.max_len}; shorten it"
                )
            return self.max_len - len(prompt)
        if len(prompt) + max_tokens > self.max_len:
            raise BadRequest(
                f"the prompt ({len(prompt)} tokens) + max_tokens ({max_tokens}) = "
                f"{len(prompt) + max_tokens} exceeds the server's max_len={self.max_len}; "
                "shorten the prompt or lower max_tokens"
            )
        return max_tokens

    def choices(
        self, prompt: list[int], body: Sampling, max_tokens: int | None, adapter: int = -1
    ) -> list[Choice]:
        if body.n > self.max_n:
            raise BadRequest(f"n={body.n} exceeds the server's limit of {self.max_n} choices")
        refused = body.refused()
        if refused:
            raise BadRequest(f"{refused} is not supported by this server; leave it unset")
        try:
            grammar = self.grammars_of(body)
            alternatives = body.alternatives()
        except ValueError as error:
            raise BadRequest(str(error)) from None
        budget = self.budget(prompt, max_tokens)
        seed = secrets.randbits(31) if body.seed is None else body.seed
        choices = []
        for i in range(body.n):
            constraint = self.grammars.constraint(grammar) if grammar else None
            choices.append(
                Choice(
                    prompt=prompt,
                    max_new_tokens=budget,
                    sampler=sampler_of(body),
                    stop_tokens=self.end_ids,
                    seed=(seed + i + 2**31) % 2**32 - 2**31,  # choice i: the seed's i-th successor
                    allowed=constraint and constraint.allowed,
                    consume=constraint and constraint.consume,
                    adapter=adapter,
                    logprobs=alternatives,
                )
            )
        return choices

    def grammars_of(self, body: Sampling) -> str | None:
        wanted = body.response_format not in (None, {"type": "text"}) or (
            body.guided_regex is not None or body.guided_grammar is not None
        )
        if not wanted:
            return None
        return self.grammars.grammar(
            body.response_format, regex=body.guided_regex, lark=body.guided_grammar
        )

    async def pieces(
        self,
        choices: list[Choice],
        stop: list[str],
        is_disconnected: Callable[[], Awaitable[bool]] | None = None,
        counts: list[int] | None = None,
    ) -> AsyncIterator[Piece]:
        """The choices' text as it comes. `counts` (if given) receives each choice's generated
        tokens. A client that disconnects (`is_disconnected`, polled while waiting) or stops
        reading ends its engine requests: their rows are freed at the engine's next step."""
        loop, queue = asyncio.get_running_loop(), asyncio.Queue()
        requests = self.worker.submit(
            choices, lambda event: loop.call_soon_threadsafe(queue.put_nowait, event)
        )
        streams = [
            TextStream(self.tokenizer.decode, stop=stop, hidden=self.end_ids) for _ in choices
        ]
        counts = [0] * len(choices) if counts is None else counts
        pending = set(range(len(choices)))
        try:
            while pending:
                event = await self._next(queue, is_disconnected)
                i = event.index
                if i not in pending:
                    continue
                stream = streams[i]
                if isinstance(event, Tokens):
                    # The engine recorded these tokens' entries before it posted them.
                    entries = requests[i].token_logprobs[counts[i] : counts[i] + len(event.tokens)]
                    entries = tuple(e for e in entries if e.token not in self.end_ids)
                    counts[i] += len(event.tokens)
                    piece = stream.feed(event.tokens)
                    if stream.stopped:  # a stop string: the engine need not go on
                        pending.discard(i)
                        self.worker.cancel([requests[i]])
                        yield Piece(i, piece, "stop", entries)
                    elif piece or entries:
                        yield Piece(i, piece, logprobs=entries)
                    continue
                pending.discard(i)
                request = event.request
                if request.error is not None:
                    raise GenerationFailed(f"choice {i} failed: {request.error}")
                ended = bool(request.tokens) and request.tokens[-1] in self.end_ids
                yield Piece(i, stream.finish(), "stop" if ended else "length")
        finally:
            self.worker.cancel([r for r in requests if not r.done])

    @staticmethod
    async def _next(queue: asyncio.Queue, is_disconnected) -> Tokens | Finished:
        if is_disconnected is None:
            return await queue.get()
        while True:
            try:
                return await asyncio.wait_for(queue.get(), timeout=0.25)
            except TimeoutError:
                if await is_disconnected():
                    raise Disconnected from None
