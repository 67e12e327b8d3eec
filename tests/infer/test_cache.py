"""The cached path: prefill + decode steps give the full forward pass's logits."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import infer
import zoo


@pytest.mark.parametrize("unstack", [False, True])
def test_prefill_then_decode_equals_full_forward(model, unstack):
    tokens = jax.random.randint(jax.random.key(1), (2, 11), 0, model.config.vocab_size)
    full = model(tokens)
    cached_model = model.unstack_layers() if unstack else model
    cache = infer.init_cache(model.config, 2, 16)
    logits, cache = infer.prefill(cached_model, tokens[:, :6], cache)
    np.testing.assert_allclose(logits, full[:, :6], rtol=1e-5, atol=1e-5)
    for t in range(6, 11):
        logits, cache = infer.decode_step(cached_model, tokens[:, t], cache)
        np.testing.assert_allclose(logits, full[:, t], rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(cache.lengths, [11, 11])


def test_left_padded_prefill_matches_each_row_alone(model):
    short = jnp.array([[5, 6, 7]])
    long = jnp.array([[9, 8, 7, 6, 5]])
    padded = jnp.concatenate([jnp.pad(short, ((0, 0), (2, 0))), long])
    cache = infer.init_cache(model.config, 2, 8)
    logits, cache = infer.prefill(model, padded, cache, lengths=jnp.array([3, 5]))
    np.testing.assert_allclose(logits[0, 2:], model(short)[0], rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(logits[1], model(long)[0], rtol=1e-5, atol=1e-5)
    # The next token continues each row at its own position.
    step, _ = infer.decode_step(model, jnp.array([4, 4]), cache)
    np.testing.assert_allclose(
        step[0], model(jnp.array([[5, 6, 7, 4]]))[0, -1], rtol=1e-5, atol=1e-5
    )
    np.testing.assert_allclose(
        step[1], model(jnp.array([[9, 8, 7, 6, 5, 4]]))[0, -1], rtol=1e-5, atol=1e-5
    )


def test_decode_step_donates_the_cache(model):
    cache = infer.init_cache(model.config, 1, 4)
    _, new_cache = infer.decode_step(model, jnp.array([1]), cache)
    assert all(k.is_deleted() for k in cache.k)
    assert not any(k.is_deleted() for k in new_cache.k)


def test_unstacked_model_forward_equals_stacked(model):
    tokens = jax.random.randint(jax.random.key(2), (1, 9), 0, model.config.vocab_size)
    np.testing.assert_allclose(model.unstack_layers()(tokens), model(tokens), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kernel", ["naive", "xla"])
@pytest.mark.parametrize(("n_heads", "n_kv_heads", "window"), [(4, 1, None), (4, 2, 3), (4, 4, 5)])
def test_ragged_decode_equals_each_row_alone(kernel, n_heads, n_kv_heads, window):
    """MQA/GQA/MHA, with and without a sliding window, over left-padded rows of different
    lengths: prefill then decode steps give each row's own full forward pass (the cache's
    `[.., head_dim, kv_seq]` values and `[.., kv_seq, head_dim]` keys read in the kernels' view)."""
    config = zoo.preset("tiny-llama").replace(
        n_heads=n_heads, n_kv_heads=n_kv_heads, sliding_window=window, attention=kernel
    )
    model = zoo.Transformer(config, key=jax.random.key(3)).unstack_layers()
    rows = [[7, 3, 9], [1, 2, 3, 4, 5, 6], [11]]
    new = jax.random.randint(jax.random.key(4), (3, 4), 0, config.vocab_size)
    longest = max(map(len, rows))
    padded = jnp.array([[0] * (longest - len(r)) + r for r in rows])
    cache = infer.init_cache(config, 3, longest + 4)
    assert cache.v[0].shape == (3, n_kv_heads, config.head_dim, longest + 4)
    logits, cache = infer.prefill(model, padded, cache, lengths=jnp.array(list(map(len, rows))))
    steps = [logits[:, -1]]
    for t in range(3):
        step, cache = infer.decode_step(model, new[:, t], cache)
        steps.append(step)
    for i, row in enumerate(rows):
        full = model(jnp.array([row + new[i, :3].tolist()]))[0, len(row) - 1 :]
        np.testing.assert_allclose(jnp.stack([s[i] for s in steps]), full, rtol=1e-5, atol=1e-5)
