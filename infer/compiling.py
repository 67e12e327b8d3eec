"""Programs compiled on background threads, each lowering once however many engines ask for it.

XLA's compile releases Python's lock, so an engine's warm-up lowers its step programs in the
calling thread (tracing holds the lock) and hands each to these threads: the engine is ready
when its programs are lowered, and a step waits only for its own program. A `generate` call's
first step then waits for the one or two programs it runs, not for every step shape's
(bench/RESULTS.md, "The first `generate`, waiting only for its own programs").

Two kinds of compile: those a request needs now run on a thread per core at the caller's
priority; those compiled ahead, in case a later request needs them (an engine's larger prompt
parts), one at a time on one thread that runs only on cores nothing else wants (Linux's
SCHED_IDLE: any other thread that wakes takes its core at once), so running requests never slow
down for them as much (at a nice value 10 above the caller's they slowed more: bench/RESULTS.md,
"Compiles made ahead on idle cores"). A compile made ahead that a caller waits for is hurried: still
queued, it moves to the threads of the caller's priority; already compiling, its thread goes
back to the caller's priority, or where the process may not raise a thread's priority (an
unprivileged one, RLIMIT_NICE 0), those threads compile it too and the first to finish answers:
a busy machine cannot starve a program a request waits for.

A compile made ahead starts only once no engine has held a request (`Hold`) for `QUIET_S`: even
at idle priority a compile beside a memory-bound step slows it (GPT-2's first `generate` by
0.4-0.6 s of 3.8-4.5), and a script's calls come back to back, so one started between two calls
slows the next (bench/RESULTS.md, "Compiles made ahead wait for a quiet moment"). One already
compiling when a request arrives finishes; one a request wants is hurried as above (an engine
meanwhile takes the programs it has: it never waits for one made ahead).

When the process ends, the compiles still queued ahead are dropped (nothing can wait for them
then; one already compiling finishes): a script that generates once and exits does not wait for
programs it never runs.
"""

import concurrent.futures
import os
import threading
import time
import weakref

import jax

_NOW = concurrent.futures.ThreadPoolExecutor(
    os.cpu_count() or 1, thread_name_prefix="eqx-zoo-compile"
)
_AHEAD = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="eqx-zoo-compile-ahead")

# Set when the main thread ends: no compile made ahead starts after it. Python's hook for "the
# main thread ended, its threads are about to be joined" is the one concurrent.futures stops its
# own threads with (hooks run last registered first: this one before theirs); without it
# (another Python) the compiles queued ahead still run at exit, which only costs time.
_ENDING = threading.Event()

# Each lowering's compile, in flight or done. JAX caches a lowering (`jit(f).lower` with the same
# arguments returns the same one) and keeps its executable once compiled: an engine of the same
# configuration built later (`generate` builds one per call) finds its programs here, compiled
# or compiling, and neither compiles them again nor queues behind other programs' compiles. An
# entry lives as long as JAX keeps the lowering (a `Compile` drops its lowering once compiled);
# a compile that failed leaves (every engine waiting for it gets its error, and the next one
# asking compiles again).
_COMPILES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_LOCK = threading.Lock()

# How many `Hold`s are held, and since when none is (`time.monotonic()`); the thread for
# compiles made ahead waits on `_QUIET` until none has been for `QUIET_S` (or the compile it
# would start was hurried, or the process is ending).
_HOLDERS = 0
_QUIET_SINCE = 0.0
_QUIET = threading.Condition(_LOCK)

# How long no request is held before a compile made ahead starts: longer than a script's pause
# between two `generate` calls (milliseconds of tokenizing and printing), whose next call one
# would slow, shorter than a person's between two chat turns.
QUIET_S = 0.5


def _end() -> None:
    with _QUIET:
        _ENDING.set()
        _QUIET.notify_all()


getattr(threading, "_register_atexit", lambda hook: None)(_end)


class Hold:
    """A caller's claim on the cores while it holds requests (an engine, from a submission until
    every request is done, and while it warms up): while any is held, and for `QUIET_S` after
    the last is let go, no compile made ahead starts. As a context manager, held inside the
    block."""

    def __init__(self):
        self.held = False

    def __enter__(self) -> "Hold":
        self.set(True)
        return self

    def __exit__(self, *exception) -> None:
        self.set(False)

    def set(self, held: bool) -> None:
        global _HOLDERS, _QUIET_SINCE
        if held == self.held:  # every engine step asks: no lock unless it changes
            return
        with _QUIET:
            self.held = held
            _HOLDERS += 1 if held else -1
            _QUIET_SINCE = time.monotonic()
            _QUIET.notify_all()


def _idle_priority() -> None:
    """The calling thread runs only on cores no other thread wants (Linux; elsewhere unchanged)."""
    if hasattr(os, "SCHED_IDLE"):
        os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))


def _restore_priority(thread: int) -> bool:
    """Put thread `thread` (a native id) back to the default policy at its nice value; False
    where this process may not (leaving SCHED_IDLE needs CAP_SYS_NICE or RLIMIT_NICE)."""
    if not hasattr(os, "SCHED_IDLE"):
        return True  # never lowered
    try:
        os.sched_setscheduler(thread, os.SCHED_OTHER, os.sched_param(0))
    except PermissionError:
        return False
    return True


class Compile:
    """One lowering's compile, queued, running or done: `result()` is the `jax.stages.Compiled`
    (waiting for it, and hurrying one made ahead); `future` to wait on several."""

    def __init__(self, lowered: jax.stages.Lowered, *, ahead: bool):
        self.future: concurrent.futures.Future = concurrent.futures.Future()
        self._lowered: jax.stages.Lowered | None = lowered  # until compiled
        self._thread: int | None = None  # the native id of the first thread compiling it
        self._hurried = not ahead
        self._asked = time.monotonic()
        if ahead:
            _AHEAD.submit(self._compile_ahead)
        else:
            _NOW.submit(self._compile)

    def done(self) -> bool:
        return self.future.done()

    def result(self) -> jax.stages.Compiled:
        if self.future.done():  # every step asks: no lock once compiled
            return self.future.result()
        self.hurry()
        return self.future.result()

    def hurry(self) -> None:
        """Compile it now, at the caller's priority, if it was made ahead (without waiting)."""
        if self.future.done():
            return
        with _LOCK:
            hurry = not self._hurried and self._lowered is not None
            self._hurried = True
            _QUIET.notify_all()  # the thread for compiles made ahead need not wait for it
            if hurry and self._thread is not None:  # compiling on the idle-priority thread
                hurry = not _restore_priority(self._thread)
        if hurry:  # queued ahead, or compiling where it cannot be raised: compile it again
            try:
                _NOW.submit(self._compile, again=True)
            except RuntimeError:  # the process is ending: its threads take no new work
                self._compile(again=True)

    def _compile_ahead(self) -> None:
        with _QUIET:
            while not (self._hurried or _ENDING.is_set()):
                if _HOLDERS:
                    _QUIET.wait()
                    continue
                left = max(_QUIET_SINCE, self._asked) + QUIET_S - time.monotonic()
                if left <= 0:
                    break
                _QUIET.wait(left)
            else:
                return  # a caller's thread compiles it / nothing runs a program made ahead now
        _idle_priority()  # again for each compile: a hurried one left the thread raised
        self._compile()

    def _compile(self, *, again: bool = False) -> None:
        """Compile the lowering unless it is done or, `again` false, another thread took it."""
        with _LOCK:
            lowered = self._lowered
            if lowered is None or (self._thread is not None and not again):
                return
            if self._thread is None:
                self._thread = threading.get_native_id()
        try:
            compiled = lowered.compile()
        except BaseException as error:  # the askers get it from `result()`; the next compiles
            self._finish(error=error)
        else:
            self._finish(compiled=compiled)

    def _finish(self, *, compiled=None, error: BaseException | None = None) -> None:
        """Answer with the first compile to finish (a hurried one may run twice)."""
        with _LOCK:
            if self._lowered is None:
                return
            self._lowered = None
            if error is not None:
                for lowering in [key for key, job in _COMPILES.items() if job is self]:
                    del _COMPILES[lowering]
        if error is not None:
            self.future.set_exception(error)
        else:
            self.future.set_result(compiled)


def compile_soon(lowered: jax.stages.Lowered, *, ahead: bool = False) -> Compile:
    """`lowered.compile()` on a background thread (`ahead`: only on otherwise idle cores, for a
    program no request waits for yet), or the compile asked for before for the same lowering
    (hurried if it was asked ahead and now is not)."""
    # `Lowered._lowering` is the object JAX caches and compiles once; without it (another JAX),
    # each request compiles on its own, which only costs time.
    lowering = getattr(lowered, "_lowering", lowered)
    with _LOCK:
        if lowering not in _COMPILES:
            _COMPILES[lowering] = Compile(lowered, ahead=ahead)
        job = _COMPILES[lowering]
    if not ahead:  # asked ahead before, needed now
        job.hurry()
    return job


def finish_compiles() -> None:
    """Wait until every compile asked for so far is done, those made ahead hurried (compiled now,
    at the caller's priority): a benchmark's steady state, or a test of step shapes, where no
    step may take a smaller prompt part for want of its program (`Engine` takes the compiled
    ones meanwhile)."""
    with _LOCK:
        jobs = list({id(job): job for job in _COMPILES.values()}.values())
    for job in jobs:
        job.result()
