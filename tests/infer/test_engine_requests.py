"""What the server needs of the engine, tested on the engine alone: requests submitted from
another thread while it runs, cancelled requests free their rows and pages, a seed fixes a
request's draws whatever shares its batch, and a per-row allowed-token mask is obeyed on the
device without recompiling."""

import threading

import jax
import numpy as np
import pytest

import infer
import zoo
from infer.engine import TRACES, Engine, allowed_words

LLAMA = zoo.preset("tiny-llama", n_layers=2, max_seq_len=256)


@pytest.fixture(scope="module")
def llama():
    return zoo.Transformer(LLAMA, key=jax.random.key(0))


def engine_of(model, **kwargs) -> Engine:
    return Engine(model, **{"max_batch": 2, "max_len": 64, "page_size": 8, "chunk": 16, **kwargs})


def test_submit_and_cancel_from_another_thread(llama):
    engine = engine_of(llama)
    first = engine.submit([1, 2, 3], max_new_tokens=40)
    waiting = [engine.submit([4, 5], max_new_tokens=40) for _ in range(2)]  # 2 rows: 1 waits
    seen = threading.Event()

    def other_thread():
        seen.wait()
        engine.cancel(first)
        engine.cancel(waiting[1])
        late.append(engine.submit([6, 7], max_new_tokens=3))

    late, thread = [], threading.Thread(target=other_thread)
    thread.start()
    while engine.busy:
        engine.step()
        if len(first.tokens) >= 2:
            seen.set()
    thread.join()
    assert first.cancelled and first.done and 2 <= len(first.tokens) < 40
    assert waiting[1].cancelled and waiting[1].tokens == []
    assert not waiting[0].cancelled and len(waiting[0].tokens) == 40
    assert late[0].done and len(late[0].tokens) == 3
    assert engine.pool.in_use == 0 and engine.rows == [None, None]
    engine.cancel(waiting[0])  # finished already: left as it is
    engine.run()
    assert not waiting[0].cancelled


def test_a_seed_fixes_the_draws_whatever_shares_the_batch(llama):
    hot = infer.Temperature(1.5)
    engine = engine_of(llama)
    alone = engine.submit([1, 2, 3], max_new_tokens=12, sampler=hot, seed=42)
    engine.run()
    crowd = [engine.submit([9, 8], max_new_tokens=5, sampler=hot) for _ in range(2)]
    again = engine.submit([1, 2, 3], max_new_tokens=12, sampler=hot, seed=42)
    other = engine.submit([1, 2, 3], max_new_tokens=12, sampler=hot, seed=43)
    engine.run()
    assert again.tokens == alone.tokens != other.tokens
    assert crowd[0].tokens != crowd[1].tokens  # default seeds: the submission numbers
    with pytest.raises(
        ValueError, match=r"seed must be an int in \[-2\*\*31, 2\*\*31\), got 2147483648"
    ):
        engine.submit([1], max_new_tokens=1, seed=2**31)


def test_a_key_of_another_implementation_keys_the_draws_too(llama):
    """The rows' draws are keyed from the engine's key whatever its implementation (here
    XLA's RNG bit generator): the same key and seed give the same tokens, another key others."""
    hot, runs = infer.Temperature(1.5), []
    for seed in (7, 7, 8):
        engine = engine_of(llama, key=jax.random.key(seed, impl="rbg"))
        runs.append(engine.submit([1, 2, 3], max_new_tokens=12, sampler=hot, seed=42))
        engine.run()
    assert runs[0].tokens == runs[1].tokens != runs[2].tokens


def test_the_allowed_mask_holds_on_the_device(llama):
    """A request allowed only tokens {5, 77, 200} (sampled hot, so the mask does the work)
    gets only those, its neighbour is unchanged, and nothing compiles."""
    engine = engine_of(llama)
    free = engine.submit([3, 4], max_new_tokens=10)
    engine.run()
    before = dict(TRACES)
    words = np.zeros(allowed_words(LLAMA.vocab_size), np.uint32)
    for token in (5, 77, 200):
        words[token // 32] |= np.uint32(1 << (token % 32))
    bits = words.view(np.int32)
    asked = []
    constrained = engine.submit(
        [1, 2, 3], max_new_tokens=20, sampler=infer.Temperature(3.0),
        allowed=lambda: asked.append(1) or bits,
    )  # fmt: skip
    beside = engine.submit([3, 4], max_new_tokens=10)
    engine.run()
    assert set(constrained.tokens) <= {5, 77, 200} and len(constrained.tokens) == 20
    assert len(set(constrained.tokens)) > 1 and len(asked) >= 20
    assert beside.tokens == free.tokens
    assert dict(TRACES) == before


def test_a_failing_mask_ends_only_its_request(llama):
    engine = engine_of(llama)

    def broken():
        raise RuntimeError("no mask today")

    bad = engine.submit([1, 2], max_new_tokens=5, allowed=broken)
    good = engine.submit([1, 2], max_new_tokens=5)
    engine.run()
    assert isinstance(bad.error, RuntimeError) and bad.done and bad.tokens == []
    assert len(good.tokens) == 5 and engine.pool.in_use == 0
