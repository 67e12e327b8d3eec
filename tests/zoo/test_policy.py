"""The run-time policy: checked field by field, swapped on the same weights without rebuilding a
layer (only a new param_dtype casts), and applied to every layer whatever the storage."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import shard
import zoo
from layers.kernels import Flash, Naive, Xla
from layers.moe import Capacity, Dropless

CONFIG = zoo.preset("tiny-llama", n_layers=2, vocab_size=64)
TOKENS = jnp.asarray(np.random.default_rng(0).integers(0, 64, (2, 16)))


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"compute_dtype": "int8"}, r"Policy\.compute_dtype='int8' is unknown"),
        ({"param_dtype": "float64"}, r"Policy\.param_dtype='float64' is unknown"),
        ({"remat": "all"}, r"Policy\.remat='all' is unknown"),
        ({"attention": "fast"}, "unknown attention kernel 'fast'"),
        ({"attention": 3}, r"Policy\.attention=3 is not an attention kernel"),
        ({"moe_dispatch": "sorted"}, r"Policy\.moe_dispatch='sorted' is unknown"),
        ({"scan_layers": "yes"}, r"Policy\.scan_layers must be a bool"),
    ],
)
def test_bad_fields_are_named(fields, message):
    with pytest.raises(ValueError, match=message):
        zoo.Policy(**fields)


def test_names_become_objects():
    policy = zoo.Policy(attention="flash", moe_dispatch="capacity")
    assert policy.attention == Flash() and policy.moe_dispatch == Capacity(1.25)
    assert zoo.Policy().attention is None and zoo.Policy().moe_dispatch == Dropless()
    # The default kernel is resolved when a model is built: xla serves a plain Llama anywhere.
    assert zoo.Transformer(CONFIG, key=jax.random.key(0)).policy.attention == Xla()
    assert hash(policy) == hash(zoo.Policy(attention=Flash(), moe_dispatch=Capacity(1.25)))


@pytest.mark.parametrize("storage", ["stacked", "unrolled"])
def test_swapping_kernel_and_remat_touches_no_weight(storage):
    model = zoo.Transformer(CONFIG, policy=zoo.Policy(storage=storage), key=jax.random.key(0))
    naive = model.with_policy(attention=Naive(), remat="full")
    assert naive.policy == zoo.Policy(attention="naive", remat="full", storage=storage)
    for a, b in zip(jax.tree.leaves(model), jax.tree.leaves(naive), strict=True):
        assert a is b  # the same arrays: nothing rebuilt, nothing copied
    np.testing.assert_allclose(naive(TOKENS), model(TOKENS), rtol=1e-5, atol=1e-5)
    flash = model.with_policy(zoo.Policy(attention="flash"))  # stacked storage, whatever before
    assert all(stack.stacked for stack in flash.stacks)
    np.testing.assert_allclose(flash(TOKENS), model(TOKENS), rtol=1e-5, atol=1e-5)


def test_a_new_param_dtype_casts_and_keeps_shardings():
    placement = shard.Placement(shard.mesh(fsdp=4, tensor=2), shard.ShardingRules.preset("fsdp_tp"))
    model = placement.init(lambda key: zoo.Transformer(CONFIG, key=key), jax.random.key(0))
    half = model.with_policy(compute_dtype="bfloat16", param_dtype="bfloat16")
    weights = jax.tree.leaves(eqx.filter(model, eqx.is_array))
    cast = jax.tree.leaves(eqx.filter(half, eqx.is_array))
    assert len(cast) == len(weights)
    for w, c in zip(weights, cast, strict=True):
        assert c.dtype == jnp.bfloat16 and c.sharding == w.sharding
        np.testing.assert_array_equal(np.asarray(c), np.asarray(w.astype(jnp.bfloat16)))
    with placement.context():
        assert eqx.filter_jit(lambda m, t: m(t))(half, TOKENS).dtype == jnp.bfloat16


def test_moe_dispatch_reaches_every_moe_layer():
    moe = zoo.Transformer(zoo.preset("tiny-moe", n_layers=2), key=jax.random.key(0))
    tokens = TOKENS % moe.config.vocab_size
    # Room for every token: capacity dispatch computes what dropless does...
    roomy = moe.with_policy(moe_dispatch=Capacity(8.0))
    np.testing.assert_allclose(roomy(tokens), moe(tokens), rtol=1e-5, atol=1e-5)
    # ... and a tight capacity drops assignments in every layer.
    tight = moe.with_policy(moe_dispatch=Capacity(0.25)).forward(tokens)
    assert (np.asarray(tight.aux.dropped_fraction) > 0).all()
