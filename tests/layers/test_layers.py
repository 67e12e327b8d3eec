"""Shapes, dtypes and reference maths of each layer."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from layers import MLP, Attention, Embedding, LayerNorm, LearnedPositions, Linear, RMSNorm, SwiGLU
from layers.kernels import Naive, Xla, causal_mask
from layers.norm import row_mean
from layers.rotary import RopeScaling, apply_rotary, inverse_frequencies, rotary_frequencies

KEY = jax.random.key(0)
B, T, D = 2, 8, 32


def x_input(dtype=jnp.float32):
    return jax.random.normal(jax.random.key(1), (B, T, D)).astype(dtype)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_linear_multi_dim_output(dtype):
    layer = Linear(D, (4, 8), axes=("embed", "heads", "head_dim"), use_bias=True, key=KEY)
    y = layer(x_input(dtype))
    assert y.shape == (B, T, 4, 8) and y.dtype == dtype
    expected = x_input() @ layer.weight.reshape(D, 32) + layer.bias.reshape(32)
    np.testing.assert_allclose(layer(x_input()).reshape(B, T, 32), expected, rtol=1e-5, atol=1e-5)


def test_linear_axes_must_name_every_dim():
    with pytest.raises(ValueError, match="must name every weight dim"):
        Linear(D, 8, axes=("embed",), key=KEY)


def test_embedding_and_tied_unembedding():
    emb = Embedding(50, D, key=KEY)
    tokens = jnp.array([[1, 2, 3]])
    x = emb(tokens)
    assert x.shape == (1, 3, D) and x.dtype == jnp.float32
    logits = emb.unembed(x)
    assert logits.shape == (1, 3, 50)
    np.testing.assert_allclose(logits, x @ emb.weight.T, rtol=1e-5)


def test_learned_positions_take_explicit_positions():
    pos = LearnedPositions(16, D, key=KEY)
    out = pos(jnp.array([[0, 1, 0, 1]]))
    np.testing.assert_array_equal(out[0, 0], out[0, 2])
    assert out.shape == (1, 4, D)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_norms_match_reference(dtype):
    x = x_input(dtype)
    x32 = x.astype(jnp.float32)
    ln = LayerNorm(D)(x)
    assert ln.dtype == dtype and ln.shape == x.shape
    ref = (x32 - x32.mean(-1, keepdims=True)) / jnp.sqrt(x32.var(-1, keepdims=True) + 1e-5)
    np.testing.assert_allclose(ln.astype(jnp.float32), ref, rtol=2e-2, atol=2e-2)
    rms = RMSNorm(D)(x)
    assert rms.dtype == dtype
    ref = x32 / jnp.sqrt((x32**2).mean(-1, keepdims=True) + 1e-5)
    np.testing.assert_allclose(rms.astype(jnp.float32), ref, rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("dim", [576, 768, 45])  # odd rests of 9, 3 and 45 after the halves
@pytest.mark.parametrize("norm", [LayerNorm, RMSNorm])
def test_a_rows_norm_is_the_same_bits_beside_any_other_rows(norm, dim):
    # Each row's statistics are summed in an order of its own (`row_mean`): with XLA's
    # reduction, SmolLM2's RMSNorm of 576 changed a row's last bits with the rows beside it.
    layer = norm(dim)
    x = jax.random.normal(KEY, (96, dim)) * jnp.linspace(0.1, 10.0, dim)
    apply = jax.jit(lambda x: layer(x))
    alone = np.stack([np.asarray(apply(x[i : i + 1]))[0] for i in range(96)])
    for rows in (2, 8, 17, 96):
        np.testing.assert_array_equal(np.asarray(apply(x[:rows])), alone[:rows])
    # and it is the mean: within float32 summation error of numpy's in float64
    x64 = np.asarray(x, np.float64)
    want = np.mean(x64**2, -1, keepdims=True)
    got = np.asarray(row_mean(jnp.square(x)))
    assert np.all(np.abs(got - want) <= dim * np.finfo(np.float32).eps * want)


def test_rotary_is_a_rotation_and_relative():
    head_dim = 16
    q = jax.random.normal(KEY, (1, 6, 2, head_dim))
    k = jax.random.normal(jax.random.key(2), (1, 6, 2, head_dim))
    pos = jnp.arange(6)[None]
    cos, sin = rotary_frequencies(pos, head_dim=head_dim, theta=10_000.0)
    qr, kr = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
    np.testing.assert_allclose(jnp.linalg.norm(qr, axis=-1), jnp.linalg.norm(q, axis=-1), rtol=1e-5)
    # Shifting every position by the same offset leaves q.k dot products unchanged.
    cos2, sin2 = rotary_frequencies(pos + 7, head_dim=head_dim, theta=10_000.0)
    qs, ks = apply_rotary(q, cos2, sin2), apply_rotary(k, cos2, sin2)
    dots = jnp.einsum("bqhd,bkhd->bhqk", qr, kr)
    np.testing.assert_allclose(jnp.einsum("bqhd,bkhd->bhqk", qs, ks), dots, rtol=1e-4, atol=1e-4)


def test_llama3_rope_scaling_bands():
    plain = inverse_frequencies(128, 500_000.0, None)
    scaled = inverse_frequencies(128, 500_000.0, RopeScaling(factor=8.0))
    np.testing.assert_allclose(scaled[0], plain[0])  # short wavelengths untouched
    np.testing.assert_allclose(scaled[-1], plain[-1] / 8.0)  # long wavelengths divided by factor
    assert np.all(scaled <= plain + 1e-12)


def test_rope_scaling_bad_factor():
    with pytest.raises(ValueError, match="factor"):
        RopeScaling(factor=0.0)


@pytest.mark.parametrize("cls", [MLP, SwiGLU])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_feed_forward_shapes(cls, dtype):
    mlp = cls(D, 64, key=KEY)
    y = mlp(x_input(dtype))
    assert y.shape == (B, T, D) and y.dtype == dtype


@pytest.mark.parametrize(("n_heads", "n_kv_heads"), [(4, 4), (4, 2), (4, 1)])
@pytest.mark.parametrize("qk_norm", [False, True])
def test_attention_shapes(n_heads, n_kv_heads, qk_norm):
    attn = Attention(
        D, n_heads=n_heads, n_kv_heads=n_kv_heads, head_dim=8, qk_norm=qk_norm, key=KEY
    )
    pos = jnp.broadcast_to(jnp.arange(T), (B, T))
    cos_sin = rotary_frequencies(pos, head_dim=8, theta=10_000.0)
    y, cache = attn(x_input(), causal_mask(pos), cos_sin, kernel=Xla())
    assert y.shape == (B, T, D) and y.dtype == jnp.float32 and cache is None


def test_attention_is_causal():
    attn = Attention(D, n_heads=4, n_kv_heads=2, head_dim=8, key=KEY)
    pos = jnp.broadcast_to(jnp.arange(T), (B, T))
    x = x_input()
    y, _ = attn(x, causal_mask(pos), kernel=Naive())
    x_changed = x.at[:, -1].add(1.0)
    y_changed, _ = attn(x_changed, causal_mask(pos), kernel=Naive())
    np.testing.assert_allclose(y[:, :-1], y_changed[:, :-1], rtol=1e-6)
    assert not np.allclose(y[:, -1], y_changed[:, -1])


def test_attention_rejects_bad_grouping():
    with pytest.raises(ValueError, match="multiple of n_kv_heads"):
        Attention(D, n_heads=4, n_kv_heads=3, head_dim=8, key=KEY)
