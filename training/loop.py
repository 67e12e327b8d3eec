"""The training loop: the compiled step over the batches, and periodic hooks (log, evaluate,
checkpoint) that run every N steps and at the last step, each given the loop's `State`.

The host waits for the device only on a step where some hook runs (metrics stay on the device
until then). `StepClock` measures the step time between two log lines, less the time the other
hooks took in between (an evaluation or a checkpoint is not a slow step).
"""

import contextlib
import dataclasses
import time
from collections.abc import Callable, Iterator
from typing import Any


@dataclasses.dataclass
class State:
    """The loop after a step: its number, parameters, optimizer state and metrics (on the
    device)."""

    step: int
    params: Any
    opt_state: Any
    metrics: Any


@dataclasses.dataclass(frozen=True)
class Hook:
    """`run(state)` every `every` steps, at the last step, and with `first` at the loop's first
    step too."""

    every: int
    run: Callable[[State], None]
    first: bool = False

    def due(self, step: int, *, start: int, stop: int) -> bool:
        return step % self.every == 0 or step == stop or (self.first and step == start + 1)


class StepClock:
    """Seconds per step and data-wait seconds per step between two `lap`s, less the time spent
    `paused` (in hooks) in between. `data_wait()` is the loader's total wait so far."""

    def __init__(self, data_wait: Callable[[], float]):
        self._data_wait = data_wait
        self._start: float | None = None
        self._steps, self._paused, self._waited = 0, 0.0, 0.0

    def step(self) -> None:
        self._steps += 1

    def lap(self) -> tuple[float, float] | None:
        """(step seconds, data-wait seconds) per step since the last lap; None at the first,
        which starts the clock (the first step includes no compile but is not timed)."""
        now, waited = time.perf_counter(), self._data_wait()
        timed = None
        if self._start is not None:
            elapsed = now - self._start - self._paused
            timed = (elapsed / self._steps, (waited - self._waited) / self._steps)
        self._start, self._steps, self._paused, self._waited = now, 0, 0.0, waited
        return timed

    @contextlib.contextmanager
    def paused(self):
        start = time.perf_counter()
        try:
            yield
        finally:
            self._paused += time.perf_counter() - start


def run(
    step_fn: Callable[[Any, Any, Any], tuple[Any, Any, Any]],
    params: Any,
    opt_state: Any,
    batches: Iterator[Any],
    *,
    start: int,
    stop: int,
    hooks: list[Hook],
    check: Callable[[State], None],
    on_step: Callable[[], None],
) -> State:
    """Steps start + 1 .. stop of `step_fn(params, opt_state, batch) -> (params, opt_state,
    metrics)`. On a step where some hook is due, `check(state)` runs first (it may stop the
    run, e.g. on a non-finite loss), then the due hooks in order. Returns the last state."""
    state = State(start, params, opt_state, None)
    for step in range(start + 1, stop + 1):
        params, opt_state, metrics = step_fn(params, opt_state, next(batches))
        state = State(step, params, opt_state, metrics)
        on_step()
        due = [hook for hook in hooks if hook.due(step, start=start, stop=stop)]
        if due:
            check(state)
            for hook in due:
                hook.run(state)
    return state
