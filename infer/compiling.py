"""Programs compiled on background threads, each lowering once however many engines ask for it.

XLA's compile releases Python's lock, so an engine's warm-up lowers its step programs in the
calling thread (tracing holds the lock) and hands each to these threads: the engine is ready
when its programs are lowered, and a step waits only for its own program. A `generate` call's
first step then waits for the one or two programs it runs, not for every step shape's
(bench/RESULTS.md, "The first `generate`, waiting only for its own programs").

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

# How much lower than the caller's the compiling threads' priority is (Linux's nice values,
# per thread): a request's steps, on programs already compiled, keep the cores while the
# larger prompt parts compile behind them.
NICER = 10


def _nicer() -> None:
    if sys.platform == "linux":
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), os.nice(0) + NICER)


_THREADS = concurrent.futures.ThreadPoolExecutor(
    os.cpu_count() or 1, thread_name_prefix="eqx-zoo-compile", initializer=_nicer
)
# Each lowering's compile, in flight or done. JAX caches a lowering (`jit(f).lower` with the same
# arguments returns the same one) and keeps its executable once compiled: an engine of the same
# configuration built later (`generate` builds one per call) finds its programs here, compiled
# or compiling, and neither compiles them again nor queues behind other programs' compiles.
# An entry lives as long as JAX keeps the lowering; a compile that failed leaves (every engine
# waiting for it gets its error, and the next one asking compiles again).
_COMPILES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_LOCK = threading.Lock()


def compile_soon(lowered: jax.stages.Lowered) -> concurrent.futures.Future:
    """`lowered.compile()` on a background thread: its future (the `jax.stages.Compiled`), or
    the one asked for before for the same lowering."""
    # `Lowered._lowering` is the object JAX caches and compiles once; without it (another JAX),
    # each request compiles on its own, which only costs time.
    lowering = getattr(lowered, "_lowering", lowered)
    with _LOCK:
        if lowering in _COMPILES:
            return _COMPILES[lowering]
        future = _COMPILES[lowering] = _THREADS.submit(lowered.compile)
    future.add_done_callback(lambda done: _forget_if_failed(lowering, done))
    return future


def _forget_if_failed(lowering: object, done: concurrent.futures.Future) -> None:
    if done.exception() is not None:
        with _LOCK:
            if _COMPILES.get(lowering) is done:
                del _COMPILES[lowering]
