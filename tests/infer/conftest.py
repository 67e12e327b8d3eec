"""Tiny models shared by the inference tests (built once per session: construction compiles)."""

import jax
import pytest

import zoo


@pytest.fixture(scope="session", params=["tiny-gpt2", "tiny-llama"])
def model(request) -> zoo.Transformer:
    return zoo.Transformer(zoo.preset(request.param), key=jax.random.key(0))
