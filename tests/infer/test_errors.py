"""Every bad input gets a ValueError naming the problem, before anything compiles."""

import jax
import jax.numpy as jnp
import pytest

import infer
import infer.generation
import zoo


@pytest.fixture(scope="module")
def llama():
    return zoo.Transformer(zoo.preset("tiny-llama"), key=jax.random.key(0))


@pytest.fixture
def no_compile(monkeypatch):
    """Fails the test if generate reaches an engine (which would compile and allocate)."""

    def engine(*args, **kwargs):
        raise AssertionError("generate built an engine before rejecting its input")

    monkeypatch.setattr(infer.generation, "Engine", engine)


@pytest.mark.parametrize(
    ("prompts", "kwargs", "message"),
    [
        ([[1, 2, 3, 4]], {"max_new_tokens": 3, "max_len": 5}, "exceeds the KV cache max_len=5"),
        ([[1, 2], []], {"max_new_tokens": 3}, "prompt 1 is empty"),
        ([], {"max_new_tokens": 3}, "prompts is empty"),
        ([[1, 2]], {"max_new_tokens": 0}, "max_new_tokens must be an int >= 1, got 0"),
        ([[1, 2]], {"max_new_tokens": -2}, "max_new_tokens must be an int >= 1, got -2"),
        ([1, 2, 3], {"max_new_tokens": 3}, r"got a flat list of ids .* pass \[\[1, 2, 3\]\]"),
        (jnp.ones((3,), jnp.int32), {"max_new_tokens": 3}, "must be 2-D"),
        (jnp.ones((1, 2, 3), jnp.int32), {"max_new_tokens": 3}, "must be 2-D"),
        ([[1.0, 2.5]], {"max_new_tokens": 3}, "must hold integer token ids, got dtype float"),
        ([[[1, 2]]], {"max_new_tokens": 3}, "prompt 0 must be a 1-D list of token ids"),
        (
            [[1, 256]],
            {"max_new_tokens": 3},
            r"prompt 0 holds token id 256 outside the vocabulary \[0, 256\)",
        ),
        ([[1, -1]], {"max_new_tokens": 3}, "token id -1 outside the vocabulary"),
        ([[1]], {"max_new_tokens": 3, "stop_tokens": (999,)}, "stop_tokens holds token id 999"),
    ],
)
def test_generate_rejects_bad_input(
    llama, no_compile, prompts, kwargs, message, without_runtime_typechecks
):
    with pytest.raises(ValueError, match=message):
        infer.generate(llama, prompts, sampler=infer.Greedy(), key=jax.random.key(0), **kwargs)


@pytest.mark.parametrize("name", ["tiny-gpt2", "tiny-llama"])
def test_prompt_beyond_max_seq_len_for_every_position_kind(no_compile, name):
    model = zoo.Transformer(zoo.preset(name, max_seq_len=128), key=jax.random.key(0))
    with pytest.raises(ValueError, match=r"\(129 tokens\) exceeds Config\.max_seq_len=128"):
        infer.generate(
            model, [[1] * 120], max_new_tokens=9, sampler=infer.Greedy(), key=jax.random.key(0)
        )


def test_prefill_and_decode_step_reject_bad_input(llama):
    cache = llama.init_cache(1, 4, page_size=4)  # room for 4 tokens exactly
    with pytest.raises(ValueError, match="do not fit the KV cache"):
        infer.prefill(llama, jnp.ones((1, 5), jnp.int32), cache)
    with pytest.raises(ValueError, match="empty prompt"):
        infer.prefill(llama, jnp.ones((1, 0), jnp.int32), cache)
    with pytest.raises(ValueError, match="token id 300 outside the vocabulary"):
        infer.decode_step(llama, jnp.array([300]), cache)
    gpt2 = zoo.Transformer(zoo.preset("tiny-gpt2"), key=jax.random.key(0))
    with pytest.raises(ValueError, match=r"\(200 tokens\) exceeds Config\.max_seq_len=128"):
        gpt2.init_cache(1, 200)


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda: infer.TopP(p=0.0), r"top-p\) must be in \(0, 1\], got 0.0"),
        (lambda: infer.TopP(p=1.5), r"top-p\) must be in \(0, 1\], got 1.5"),
        (lambda: infer.Temperature(temperature=-0.5), "temperature must be >= 0"),
        (lambda: infer.TopK(k=5, temperature=-1.0), "temperature must be >= 0"),
        (lambda: infer.TopK(k=0), "TopK.k must be >= 1"),
        (lambda: infer.MinP(p=2.0), r"min-p\) must be in \[0, 1\]"),
    ],
)
def test_samplers_reject_bad_settings(make, message):
    with pytest.raises(ValueError, match=message):
        make()
