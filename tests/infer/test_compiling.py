"""Programs compiled on background threads (infer/compiling.py): one compile per lowering however
many ask for it while it runs or after; a compile made ahead that a caller then waits for leaves
the queue of those made ahead; those made ahead run at idle priority, go back to the caller's
when a caller waits for them (or, where that is not permitted, compile again at the caller's),
and those still queued when the process ends are dropped; none starts while a caller holds
requests (a `Hold`), nor until none has for a moment, unless hurried; `finish_compiles` hurries
and waits for them all; a failed compile's error reaches every asker while the next one to ask
compiles again."""

import gc
import os
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import jax
import jax.numpy as jnp
import pytest

import infer.compiling
from infer.compiling import Hold, compile_soon, finish_compiles

IDLE_POLICY = hasattr(os, "SCHED_IDLE")  # Linux: compiles made ahead run at SCHED_IDLE


class Lowering:
    """What JAX caches and compiles once (`Lowered._lowering`)."""


class Compiled(jax.stages.Compiled):
    """What a compile returns."""

    def __init__(self):
        pass


COMPILED = Compiled()


class Lowered(jax.stages.Lowered):
    """A lowered program whose compile waits for `release` and fails while `failures` is
    positive; `calls` counts the compiles."""

    def __init__(self, lowering, release, state):
        self._lowering, self.release, self.state = lowering, release, state

    def compile(self, compiler_options=None):
        if IDLE_POLICY:  # the compiling thread's, as it starts
            self.state.setdefault("threads", []).append(threading.get_native_id())
            self.state.setdefault("policies", []).append(os.sched_getscheduler(0))
        self.release.wait()
        self.state["calls"] += 1
        if self.state["failures"]:
            self.state["failures"] -= 1
            raise RuntimeError("the compiler ran out of memory")
        return COMPILED


def test_a_lowering_compiles_once_for_every_asker_in_flight_or_after():
    lowering, release, state = Lowering(), threading.Event(), {"calls": 0, "failures": 0}
    first = compile_soon(Lowered(lowering, release, state))
    second = compile_soon(Lowered(lowering, release, state))  # asked while the first runs
    assert second is first and not first.done()
    release.set()
    assert first.result() is COMPILED
    assert compile_soon(Lowered(lowering, release, state)) is first
    assert state["calls"] == 1
    other = compile_soon(Lowered(Lowering(), release, state))  # another lowering compiles
    assert other is not first and other.result() is COMPILED and state["calls"] == 2


def test_a_failed_compile_reaches_its_askers_and_the_next_asker_compiles_again():
    lowering, release, state = Lowering(), threading.Event(), {"calls": 0, "failures": 1}
    first = compile_soon(Lowered(lowering, release, state))
    waiting = compile_soon(Lowered(lowering, release, state))
    release.set()
    for job in (first, waiting):
        with pytest.raises(RuntimeError, match="out of memory"):
            job.result()
    again = compile_soon(Lowered(lowering, release, state))
    assert again is not first and again.result() is COMPILED and state["calls"] == 2


def test_a_compile_made_ahead_and_waited_for_does_not_queue_behind_those_made_ahead():
    release, state = threading.Event(), {"calls": 0, "failures": 0}
    # The thread for compiles made ahead busy until `release` (and more queued behind it).
    busy = [
        compile_soon(Lowered(Lowering(), release, state), ahead=True)
        for _ in range(os.cpu_count() or 1)
    ]
    ready = threading.Event()
    ready.set()
    queued = compile_soon(Lowered(Lowering(), ready, state), ahead=True)
    results = []
    waiter = threading.Thread(target=lambda: results.append(queued.result()))
    waiter.start()
    waiter.join(timeout=60)  # a guard against a hang, not a measure of speed
    finished = not waiter.is_alive()
    release.set()
    assert finished and results == [COMPILED]
    assert [job.result() for job in busy] == [COMPILED] * len(busy)
    assert state["calls"] == len(busy) + 1  # the hurried compile ran once


def test_a_compile_made_ahead_starts_a_quiet_moment_after_the_last_hold_unless_hurried():
    gc.collect()  # an engine an earlier test dropped holding requests lets go of its hold
    ready, state = threading.Event(), {"calls": 0, "failures": 0}
    ready.set()
    with Hold():
        waits = compile_soon(Lowered(Lowering(), ready, state), ahead=True)
        hurried = compile_soon(Lowered(Lowering(), ready, state), ahead=True)
        hurried.hurry()  # compiled at once on the caller's threads, the hold still held
        wait_until(hurried.done)
        threading.Event().wait(0.2)  # room for a wrongly started compile to finish
        held = (waits.done(), state["calls"])
    released = (waits.done(), state["calls"])  # it waits for QUIET_S without a hold first
    wait_until(waits.done)
    assert held == released == (False, 1) and waits.result() is hurried.result() is COMPILED
    assert state["calls"] == 2


def test_finish_compiles_waits_for_every_compile_made_ahead():
    ready, state = threading.Event(), {"calls": 0, "failures": 0}
    ready.set()
    with Hold():  # none would start on its own
        jobs = [compile_soon(Lowered(Lowering(), ready, state), ahead=True) for _ in range(3)]
        finish_compiles()
        assert all(job.done() for job in jobs) and state["calls"] == 3


def test_a_jax_lowering_compiles_to_the_program_it_lowered():
    lowered = jax.jit(lambda x: x * 3 + 1).lower(jnp.arange(4.0))
    program = compile_soon(lowered).result()
    assert jnp.array_equal(program(jnp.arange(4.0)), jnp.arange(4.0) * 3 + 1)


def wait_until(condition) -> None:
    """Poll `condition` until it holds (a guard against a hang, not a measure of speed)."""
    for _ in range(6000):
        if condition():
            return
        threading.Event().wait(0.01)
    raise AssertionError("timed out")


@pytest.mark.skipif(not IDLE_POLICY, reason="priorities by scheduling policy are Linux's")
def test_a_compile_made_ahead_runs_at_idle_priority_until_a_caller_waits_for_it():
    release, state = threading.Event(), {"calls": 0, "failures": 0}
    job = compile_soon(Lowered(Lowering(), release, state), ahead=True)
    waiter = threading.Thread(target=job.result)
    try:
        wait_until(lambda: "policies" in state)  # the ahead thread runs it
        idle = state["policies"] == [os.SCHED_IDLE]
        waiter.start()
        # The waiter puts the compiling thread back to the default policy or, where this
        # process may not, compiles the lowering again at its own priority.
        thread = state["threads"][0]
        wait_until(
            lambda: os.sched_getscheduler(thread) != os.SCHED_IDLE or len(state["policies"]) == 2
        )
    finally:
        release.set()  # a failure leaves no thread blocked
    waiter.join(timeout=60)
    assert idle and not waiter.is_alive() and job.result() is COMPILED


@pytest.mark.skipif(not IDLE_POLICY, reason="priorities by scheduling policy are Linux's")
def test_a_waiter_that_may_not_raise_the_compile_ahead_compiles_it_at_its_own_priority(
    monkeypatch,
):
    # Unprivileged, a process cannot take a thread out of SCHED_IDLE: the waiter must not depend on
    # the idle thread, which a busy machine may starve (here it never finishes until released).
    monkeypatch.setattr(infer.compiling, "_restore_priority", lambda thread: False)
    starved, ready, state = threading.Event(), threading.Event(), {"calls": 0, "failures": 0}
    ready.set()
    lowered = Lowered(Lowering(), starved, state)
    job = compile_soon(lowered, ahead=True)
    results = []
    waiter = threading.Thread(target=lambda: results.append(job.result()))
    try:
        wait_until(lambda: "policies" in state)  # the ahead thread runs it
        lowered.release = ready  # the second compile finishes at once
        waiter.start()
        waiter.join(timeout=60)  # a guard against a hang, not a measure of speed
        finished = not waiter.is_alive()
    finally:
        starved.set()  # a failure leaves no thread blocked
    assert finished and results == [COMPILED]
    assert state["policies"] == [os.SCHED_IDLE, os.SCHED_OTHER]


ENDING = """
import threading
from pathlib import Path
import jax
from infer import compiling

class Lowered(jax.stages.Lowered):
    def __init__(self, name):
        self.name = name
    def compile(self, compiler_options=None):
        started.set()
        compiling._ENDING.wait()  # runs until the main thread has ended
        with open(LOG, "a") as log:
            log.write(self.name + "\\n")

started = threading.Event()
jobs = [compiling.compile_soon(Lowered(f"ahead {i}"), ahead=True) for i in range(3)]
started.wait()
"""


def test_compiles_queued_ahead_are_dropped_when_the_process_ends(tmp_path):
    log = tmp_path / "compiled.txt"
    script = f"LOG = {str(log)!r}\n" + textwrap.dedent(ENDING)
    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "PYTHONPATH": str(root)}
    subprocess.run([sys.executable, "-c", script], check=True, env=env, timeout=300)
    # The first was compiling when the main thread ended and finished; the other two never ran.
    assert log.read_text().splitlines() == ["ahead 0"]
