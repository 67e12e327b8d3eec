"""`generate`'s arguments are checked at the boundary by zoo.arguments (issue 26): NumPy integer
counts are counts, a bool or a float is not, a callback must be callable and the model a
Transformer, each a ValueError naming the argument before anything is compiled."""

import jax
import numpy as np
import pytest

import infer
import zoo
from tests.zoo.random_model import random_model

CONFIG = zoo.preset("tiny-llama", vocab_size=64, d_model=32, d_ff=48, max_seq_len=64)
PROMPT = [[1, 2, 3]]


@pytest.fixture(scope="module")
def llama():
    return random_model(CONFIG, 0)


def run(model, **kwargs):
    arguments = {"max_new_tokens": 2, "sampler": infer.Greedy(), "key": jax.random.key(0)}
    return infer.generate(model, PROMPT, **(arguments | kwargs))


def test_numpy_integer_counts_are_counts(llama):
    plain = run(llama, max_new_tokens=3, chunk_size=2, max_len=32)
    assert run(llama, max_new_tokens=np.int64(3), chunk_size=np.int32(2), max_len=np.int64(32)) == (
        plain
    )


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"max_new_tokens": True}, "max_new_tokens must be an int >= 1, got True"),
        ({"max_new_tokens": 2.0}, "max_new_tokens must be an int >= 1, got 2.0"),
        ({"chunk_size": 2.5}, "chunk_size must be an int >= 1, got 2.5"),
        ({"max_len": "32"}, "max_len must be an int >= 1, got '32'"),
        ({"on_tokens": 3}, r"on_tokens must be callable \(new tokens per row -> None\)"),
        ({"sampler": "greedy"}, r"sampler must be an infer sampler \(Greedy\(\), "),
        ({"key": 3}, r"key must be a jax.random.key\(...\) \(one key, not a batch\), got 3"),
        ({"stop_tokens": 5}, "stop_tokens must be a list of token ids, got 5"),
        ({"stop_tokens": "ab"}, "stop_tokens must hold integer token ids"),
        ({"tokenizer": "x"}, r"tokenizer must be a Tokenizer \(zoo.load_tokenizer\(path\)\)"),
        ({"placement": "dp"}, r"placement must be a Placement \(shard.Placement\(mesh, rules\)"),
    ],
)
def test_wrong_types_are_named(llama, kwargs, message, without_runtime_typechecks):
    with pytest.raises(ValueError, match=message):
        run(llama, **kwargs)


def test_a_model_that_is_not_a_transformer(without_runtime_typechecks):
    with pytest.raises(ValueError, match=r"model must be a Transformer .*not a str"):
        run("smollm2-135m")


def test_an_engine_of_something_else(without_runtime_typechecks):
    with pytest.raises(ValueError, match=r"Engine needs a zoo\.Transformer, got str"):
        infer.Engine("smollm2-135m", max_batch=1, max_len=32)


def test_an_engine_placement_that_is_not_a_placement(llama, without_runtime_typechecks):
    with pytest.raises(ValueError, match=r"Engine placement must be a Placement .*not a str"):
        infer.Engine(llama, max_batch=1, max_len=32, placement="dp")
