"""Programs compiled on background threads (infer/compiling.py): one compile per lowering however
many ask for it while it runs or after; a compile made ahead that a caller then waits for leaves
the queue of those made ahead; a failed compile's error reaches every asker while the next one to
ask compiles again."""

import os
import threading

import jax
import jax.numpy as jnp
import pytest

from infer.compiling import compile_soon


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


def test_a_jax_lowering_compiles_to_the_program_it_lowered():
    lowered = jax.jit(lambda x: x * 3 + 1).lower(jnp.arange(4.0))
    program = compile_soon(lowered).result()
    assert jnp.array_equal(program(jnp.arange(4.0)), jnp.arange(4.0) * 3 + 1)
