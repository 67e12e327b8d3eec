"""`EngineThread`: the engine on its own thread, fed by the HTTP handlers (an asyncio loop).

Handlers call `submit` (any thread): the choices of one HTTP request become engine requests at
once, or none do (`QueueFull` when the queue would pass its limit). The thread steps the engine
while it has work and sleeps on a condition otherwise. What a choice produces is posted back to
the loop as events, in order: `Tokens(index, tokens)` as they come, then `Finished(index,
request)` once the engine is done with it (stopped, cancelled or failed). `cancel` ends
requests (a client that went away): the engine frees their rows at its next step.

A failure inside one request (its grammar, a closed loop) ends that request alone (the engine
keeps a failing callback's error on its request). A failure of the step itself ends every
request in flight with that error and marks the thread `failed`: later submissions are refused
with it (the server answers 503), since the engine's device state may be gone.
"""

import contextlib
import dataclasses
import threading
from collections.abc import Callable

from infer.engine import AllowedTokens, Engine, Request
from infer.sampling import Sampler


@dataclasses.dataclass(frozen=True)
class Tokens:
    index: int
    tokens: list[int]


@dataclasses.dataclass(frozen=True)
class Finished:
    index: int
    request: Request


Post = Callable[[Tokens | Finished], None]


class QueueFull(Exception):
    """The engine's queue is at its limit; the client should retry later."""


class EngineFailed(Exception):
    """The engine's step failed; the server cannot serve any more requests."""


@dataclasses.dataclass(frozen=True)
class Choice:
    """One engine request of an HTTP request: its prompt and settings; `consume` sees its
    tokens on the engine's thread before the next `allowed` (a grammar's state)."""

    prompt: list[int]
    max_new_tokens: int
    sampler: Sampler
    stop_tokens: tuple[int, ...]
    seed: int | None = None
    allowed: AllowedTokens | None = None
    consume: Callable[[list[int]], None] | None = None
    adapter: int = -1
    logprobs: int | None = None  # the engine's submit(logprobs=)


class EngineThread:
    """Runs `engine` on a daemon thread; at most `max_waiting` requests wait beyond the rows."""

    def __init__(self, engine: Engine, *, max_waiting: int):
        self.engine, self.max_waiting = engine, max_waiting
        self.active: dict[int, tuple[Request, int, Post]] = {}  # id(request) -> what to tell
        self.failed: Exception | None = None
        self._wake = threading.Condition()
        self._stopping = False
        self._thread = threading.Thread(target=self._loop, name="engine", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        """Finish what is in flight, then end the thread."""
        with self._wake:
            self._stopping = True
            self._wake.notify()
        self._thread.join()

    @property
    def load(self) -> int:
        """Engine requests not finished yet."""
        return len(self.active)

    def submit(self, choices: list[Choice], post: Post) -> list[Request]:
        """Queue the choices as engine requests, all or none: a ValueError from the engine (too
        long, bad ids) or `QueueFull` leaves nothing queued."""
        with self._wake:
            if self.failed is not None:
                raise EngineFailed(f"the engine failed: {self.failed!r}")
            if self._stopping:
                raise QueueFull("the server is shutting down")
            if self.load + len(choices) > self.engine.max_batch + self.max_waiting:
                raise QueueFull(
                    f"{self.load} requests in flight, at most {self.engine.max_batch} running "
                    f"+ {self.max_waiting} waiting"
                )
            requests = []
            try:
                for index, choice in enumerate(choices):
                    requests.append(self._submit(choice, index, post))
            except Exception:
                for request in requests:
                    self.engine.cancel(request)
                raise
            for index, request in enumerate(requests):
                self.active[id(request)] = (request, index, post)
            self._wake.notify()
        return requests

    def _submit(self, choice: Choice, index: int, post: Post) -> Request:
        def on_tokens(tokens: list[int]) -> None:
            if choice.consume is not None:
                choice.consume(tokens)
            post(Tokens(index, tokens))

        return self.engine.submit(
            choice.prompt,
            max_new_tokens=choice.max_new_tokens,
            sampler=choice.sampler,
            stop_tokens=choice.stop_tokens,
            seed=choice.seed,
            allowed=choice.allowed,
            adapter=choice.adapter,
            logprobs=choice.logprobs,
            on_tokens=on_tokens,
        )

    def cancel(self, requests: list[Request]) -> None:
        with self._wake:
            for request in requests:
                self.engine.cancel(request)
            self._wake.notify()

    def _loop(self) -> None:
        while True:
            with self._wake:
                while not self.engine.busy and not self._stopping:
                    self._wake.wait()
                if self._stopping and not self.engine.busy:
                    return
            try:
                self.engine.step()
            except Exception as error:  # the step itself: nothing in flight can go on
                self._fail(error)
                return
            self._report_finished()

    def _report_finished(self) -> None:
        with self._wake:
            finished = [entry for entry in self.active.values() if entry[0].done]
            for request, _, _ in finished:
                del self.active[id(request)]
        for request, index, post in finished:
            with contextlib.suppress(RuntimeError):  # a closed loop: nobody is listening
                post(Finished(index, request))

    def _fail(self, error: Exception) -> None:
        with self._wake:
            self.failed = error
            entries, self.active = list(self.active.values()), {}
        for request, index, post in entries:
            request.error, request.done = error, True
            with contextlib.suppress(RuntimeError):
                post(Finished(index, request))
