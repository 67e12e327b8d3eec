"""Sampler statistics: kept sets of top-k / top-p / min-p, temperature -> 0 is greedy, seeds."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import infer

LOGITS = jax.random.normal(jax.random.key(0), (16, 40)) * 3.0
KEYS = jax.random.split(jax.random.key(1), 300)


def draws(sampler, logits=LOGITS):
    """[n_keys, batch] tokens, one draw per key."""
    return np.asarray(jax.vmap(lambda k: sampler(logits, k))(KEYS))


def test_top_k_never_leaves_the_k_largest():
    k = 5
    top = np.argsort(-np.asarray(LOGITS), axis=-1)[:, :k]
    tokens = draws(infer.TopK(k=k, temperature=2.0))
    for row in range(LOGITS.shape[0]):
        assert set(tokens[:, row]) <= set(top[row])
    assert len(set(tokens[:, 0])) > 1  # it does sample, not just argmax


@pytest.mark.parametrize("temperature", [0.0, 1e-4])
def test_temperature_to_zero_is_greedy(temperature):
    tokens = draws(infer.Temperature(temperature=temperature))
    np.testing.assert_array_equal(tokens, np.broadcast_to(np.argmax(LOGITS, -1), tokens.shape))


def test_same_key_same_tokens_and_frequencies_follow_softmax():
    sampler = infer.Temperature(temperature=1.0)
    logits = jnp.log(jnp.array([[0.5, 0.3, 0.15, 0.05]]))
    np.testing.assert_array_equal(draws(sampler, logits), draws(sampler, logits))
    keys = jax.random.split(jax.random.key(2), 4000)
    tokens = np.asarray(jax.vmap(lambda k: sampler(logits, k))(keys))[:, 0]
    np.testing.assert_allclose(
        np.bincount(tokens, minlength=4) / 4000, [0.5, 0.3, 0.15, 0.05], atol=0.03
    )


PROBS = jnp.log(jnp.array([[0.5, 0.3, 0.15, 0.05]]))


@pytest.mark.parametrize(
    ("sampler", "kept"),
    [
        (infer.TopP(p=0.5), {0}),
        (infer.TopP(p=0.8), {0, 1}),
        (infer.TopP(p=0.81), {0, 1, 2}),
        (infer.TopP(p=1.0), {0, 1, 2, 3}),
        (infer.MinP(p=0.5), {0, 1}),
        (infer.MinP(p=0.3), {0, 1, 2}),
        (infer.TopK(k=3), {0, 1, 2}),
    ],
)
def test_filters_keep_the_right_set(sampler, kept):
    filtered = np.asarray(sampler.filter(PROBS))[0]
    assert set(np.flatnonzero(np.isfinite(filtered))) == kept
    assert set(draws(sampler, PROBS)[:, 0]) == kept


def test_top_p_on_shuffled_vocab_keeps_the_most_likely():
    # The kept set must follow probability, not index order.
    logits = jnp.log(jnp.array([[0.05, 0.3, 0.15, 0.5]]))
    filtered = np.asarray(infer.TopP(p=0.8).filter(logits))[0]
    assert set(np.flatnonzero(np.isfinite(filtered))) == {1, 3}
