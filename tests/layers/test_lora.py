"""layers.LoRA: a new adapter changes nothing, the update is scale · x·A·B on multi-dim
projections, merging folds it into the weight within float32 rounding, dropout needs a key."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from layers import Linear, LoRA

EPS = float(jnp.finfo(jnp.float32).eps)


def q_projection(key) -> Linear:
    """A q projection `[embed=16] -> [heads=2, head_dim=8]`, with a bias."""
    return Linear(16, (2, 8), axes=("embed", "heads", "head_dim"), use_bias=True, key=key)


def with_random_b(lora: LoRA, key) -> LoRA:
    return jax.tree_util.tree_map_with_path(
        lambda path, w: jax.random.normal(key, w.shape) if "lora_b" in str(path) else w, lora
    )


def test_new_adapter_equals_its_base():
    base = q_projection(jax.random.key(0))
    lora = LoRA(base, rank=4, alpha=8.0, key=jax.random.key(1))
    x = jax.random.normal(jax.random.key(2), (3, 5, 16))
    np.testing.assert_array_equal(lora(x), base(x))
    assert lora.lora_a.shape == (16, 4) and lora.lora_b.shape == (4, 2, 8)
    assert not np.any(lora.lora_b)
    # Fan-in normal A, as Linear's init: std 1/sqrt(16), within a few sampling errors.
    assert abs(float(jnp.std(lora.lora_a)) - 0.25) < 0.25 * 4 / np.sqrt(64)


def test_update_is_scaled_low_rank_product():
    lora = with_random_b(
        LoRA(q_projection(jax.random.key(0)), rank=4, alpha=2.0, key=jax.random.key(1)),
        jax.random.key(3),
    )
    x = np.asarray(jax.random.normal(jax.random.key(2), (3, 16)), np.float64)
    a, b = np.asarray(lora.lora_a, np.float64), np.asarray(lora.lora_b, np.float64)
    w, bias = np.asarray(lora.base.weight, np.float64), np.asarray(lora.base.bias, np.float64)
    expected = np.einsum("ni,ihk->nhk", x, w) + bias + 0.5 * np.einsum("ni,ir,rhk->nhk", x, a, b)
    np.testing.assert_allclose(lora(jnp.asarray(x, jnp.float32)), expected, rtol=1e-5, atol=1e-5)


def test_merged_equals_unmerged_within_rounding():
    """Unmerged: x·W + s·(x·A)·B; merged: x·(W + s·A·B). Each float32 dot product of length n
    is within n·eps·Σ|terms| of the exact one (the classic γ_n bound), so both lie within
    (n_in + rank + 2)·eps·(|x|·|W| + s·|x|·|A|·|B|) of the exact value: the +2 counts the sums
    of the two paths, the scale and the bias. Twice that bounds their difference."""
    lora = with_random_b(
        LoRA(q_projection(jax.random.key(0)), rank=4, alpha=8.0, key=jax.random.key(1)),
        jax.random.key(3),
    )
    merged = lora.merged()
    assert isinstance(merged, Linear) and merged.weight.shape == (16, 2, 8)
    x = jax.random.normal(jax.random.key(2), (4, 16))
    ax, aw, aa, ab = (
        np.abs(np.asarray(t)) for t in (x, lora.base.weight, lora.lora_a, lora.lora_b)
    )
    magnitude = np.einsum("ni,ihk->nhk", ax, aw) + lora.scale * np.einsum(
        "ni,ir,rhk->nhk", ax, aa, ab
    )
    bound = 2 * (16 + 4 + 2) * EPS * magnitude
    assert np.all(np.abs(np.asarray(merged(x)) - np.asarray(lora(x))) <= bound)


def test_computes_in_the_calls_dtype():
    lora = LoRA(q_projection(jax.random.key(0)), rank=4, alpha=8.0, key=jax.random.key(1))
    assert lora.lora_a.dtype == jnp.float32
    x = jnp.ones((2, 16), jnp.bfloat16)
    assert lora(x).dtype == jnp.bfloat16
    assert lora(x.astype(jnp.float32), dtype=jnp.bfloat16).dtype == jnp.bfloat16
    stored = LoRA(
        q_projection(jax.random.key(0)), rank=2, alpha=2, dtype=jnp.bfloat16, key=jax.random.key(1)
    )
    assert stored.lora_b.dtype == jnp.bfloat16


def test_dropout_only_with_a_key():
    lora = with_random_b(
        LoRA(q_projection(jax.random.key(0)), rank=4, alpha=8, dropout=0.5, key=jax.random.key(1)),
        jax.random.key(3),
    )
    no_drop = with_random_b(
        LoRA(q_projection(jax.random.key(0)), rank=4, alpha=8, key=jax.random.key(1)),
        jax.random.key(3),
    )
    x = jax.random.normal(jax.random.key(2), (4, 16))
    np.testing.assert_array_equal(lora(x), no_drop(x))
    dropped = lora(x, key=jax.random.key(5))
    assert not np.allclose(dropped, no_drop(x))
    np.testing.assert_array_equal(dropped, lora(x, key=jax.random.key(5)))


def test_logical_axes_add_the_rank_axis():
    lora = LoRA(q_projection(jax.random.key(0)), rank=4, alpha=8, key=jax.random.key(1))
    assert lora.logical_axes() == {
        "lora_a": ("embed", "lora_rank"),
        "lora_b": ("lora_rank", "heads", "head_dim"),
    }
    out = Linear((2, 8), 16, axes=("heads", "head_dim", "embed"), key=jax.random.key(0))
    assert LoRA(out, rank=3, alpha=3, key=jax.random.key(1)).logical_axes() == {
        "lora_a": ("heads", "head_dim", "lora_rank"),
        "lora_b": ("lora_rank", "embed"),
    }


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"rank": 0}, "rank must be an integer >= 1"),
        ({"rank": 2, "dropout": 1.0}, r"dropout must be in \[0, 1\)"),
    ],
)
def test_bad_settings_are_refused(kwargs, message):
    with pytest.raises(ValueError, match=message):
        LoRA(q_projection(jax.random.key(0)), alpha=1.0, key=jax.random.key(1), **kwargs)
