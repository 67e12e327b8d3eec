"""zoo.with_runtime: the same weights under other run-time settings (the layers take them too),
and architecture changes refused."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import zoo
from layers.moe.dispatch import Capacity

CONFIG = zoo.preset("tiny-llama", n_layers=1, vocab_size=64)
TOKENS = jnp.asarray(np.random.default_rng(0).integers(0, 64, (2, 8)))


def test_same_weights_other_kernel_remat_and_dtypes():
    model = zoo.Transformer(CONFIG, key=jax.random.key(0))
    assert model.blocks.attn.kernel == "xla"
    naive = zoo.with_runtime(model, attention="naive", remat="full")
    assert naive.blocks.attn.kernel == "naive"
    assert naive.config == CONFIG.replace(attention="naive", remat="full")
    np.testing.assert_allclose(naive(TOKENS), model(TOKENS), rtol=1e-5, atol=1e-5)

    half = zoo.with_runtime(model, dtype="bfloat16", param_dtype="bfloat16")
    weights = jax.tree.leaves(eqx.filter(model, eqx.is_array))
    cast = jax.tree.leaves(eqx.filter(half, eqx.is_array))
    assert len(cast) == len(weights)
    for w, c in zip(weights, cast, strict=True):
        assert c.dtype == jnp.bfloat16
        np.testing.assert_array_equal(np.asarray(c), np.asarray(w.astype(jnp.bfloat16)))
    assert half(TOKENS).dtype == jnp.bfloat16


def test_moe_dispatch_reaches_the_layer():
    moe = zoo.Transformer(zoo.preset("tiny-moe", n_layers=1), key=jax.random.key(0))
    capacity = zoo.with_runtime(moe, moe_dispatch="capacity", capacity_factor=8.0)
    assert isinstance(capacity.blocks.mlp.dispatch, Capacity)
    assert capacity.blocks.mlp.dispatch.capacity_factor == 8.0
    # Room for every token: capacity dispatch computes what dropless does.
    tokens = TOKENS % moe.config.vocab_size
    np.testing.assert_allclose(capacity(tokens), moe(tokens), rtol=1e-5, atol=1e-5)


def test_architecture_and_unstacked_models_are_refused():
    model = zoo.Transformer(CONFIG, key=jax.random.key(0))
    with pytest.raises(ValueError, match=r"cannot change \['d_model', 'n_layers'\]"):
        zoo.with_runtime(model, n_layers=2, d_model=64, remat="full")
    with pytest.raises(ValueError, match="call with_runtime on the stacked model"):
        zoo.with_runtime(model.unstack_layers(), attention="naive")
