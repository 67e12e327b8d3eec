"""Programs compiled on background threads, each lowering once however many engines ask for it.

XLA's compile releases Python's lock, so an engine's warm-up lowers its step programs in the
calling thread (tracing holds the lock) and hands each to these threads: the engine is ready
when its programs are lowered, and a step waits only for its own program. A `generate` call's
first step then waits for the one or two programs it runs, not for every step shape's
(bench/RESULTS.md, "The first `generate`, waiting only for its own programs").

Two kinds of compile: those a request needs now run on a thread per core at the caller's
priority; those compiled ahead, in case a later request needs them (an engine's larger prompt
parts), one at a time on one thread of lower priority (Linux's nice values, per thread), so a
request's steps and another engine's first programs keep most of the cores (two threads ahead
made the next `generate` call wait for both: bench/RESULTS.md). A compile asked for ahead and
then waited for before its thread took it moves to the threads of the caller's priority.

The threads run every program handed to them, also at the process's exit: nothing is left
half-compiled, and a process that ends right after its first call takes as long as one that
waited for every program before its first step.
"""

import concurrent.futures
import os
import sys
import threading
import weakref

import jax

# How much lower than the caller's the priority of the compiles made ahead is (nice values).
NICER = 10


def _nicer() -> None:
    if sys.platform == "linux":
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), os.nice(0) + NICER)


_NOW = concurrent.futures.ThreadPoolExecutor(
    os.cpu_count() or 1, thread_name_prefix="eqx-zoo-compile"
)
_AHEAD = concurrent.futures.ThreadPoolExecutor(
    1, thread_name_prefix="eqx-zoo-compile-ahead", initializer=_nicer
)

# Each lowering's compile, in flight or done. JAX caches a lowering (`jit(f).lower` with the same
# arguments returns the same one) and keeps its executable once compiled: an engine of the same
# configuration built later (`generate` builds one per call) finds its programs here, compiled
# or compiling, and neither compiles them again nor queues behind other programs' compiles. An
# entry lives as long as JAX keeps the lowering (a `Compile` drops its lowering once a thread
# takes it); a compile that failed leaves (every engine waiting for it gets its error, and the
# next one asking compiles again).
_COMPILES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_LOCK = threading.Lock()


class Compile:
    """One lowering's compile, queued, running or done: `result()` is the `jax.stages.Compiled`
    (waiting for it, and hurrying a compile still queued ahead); `future` to wait on several."""

    def __init__(self, lowered: jax.stages.Lowered, *, ahead: bool):
        self.future: concurrent.futures.Future = concurrent.futures.Future()
        self._lowered: jax.stages.Lowered | None = lowered
        self._hurried = not ahead
        (_AHEAD if ahead else _NOW).submit(self._run)

    def done(self) -> bool:
        return self.future.done()

    def result(self) -> jax.stages.Compiled:
        if self.future.done():  # every step asks: no lock once compiled
            return self.future.result()
        with _LOCK:
            hurry = self._lowered is not None and not self._hurried
            self._hurried = True
        if hurry:  # still queued behind the compiles made ahead: the caller's threads take it
            _NOW.submit(self._run)
        return self.future.result()

    def _run(self) -> None:
        with _LOCK:  # the first thread to take it compiles it; a second finds it taken
            lowered, self._lowered = self._lowered, None
        if lowered is None:
            return
        self.future.set_running_or_notify_cancel()
        try:
            self.future.set_result(lowered.compile())
        except BaseException as error:  # the askers get it from `result()`; the next compiles
            with _LOCK:
                for lowering in [key for key, job in _COMPILES.items() if job is self]:
                    del _COMPILES[lowering]
            self.future.set_exception(error)


def compile_soon(lowered: jax.stages.Lowered, *, ahead: bool = False) -> Compile:
    """`lowered.compile()` on a background thread (`ahead`: at a lower priority, for a program
    no request waits for yet), or the compile asked for before for the same lowering."""
    # `Lowered._lowering` is the object JAX caches and compiles once; without it (another JAX),
    # each request compiles on its own, which only costs time.
    lowering = getattr(lowered, "_lowering", lowered)
    with _LOCK:
        if lowering not in _COMPILES:
            _COMPILES[lowering] = Compile(lowered, ahead=ahead)
        return _COMPILES[lowering]
