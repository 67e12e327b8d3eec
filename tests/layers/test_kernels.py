"""Every kernel equals the naive specification in values and gradients."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from layers.kernels import (
    AttentionMask,
    Flash,
    Naive,
    Xla,
    causal_mask,
    kernel_named,
    naive_attention,
    xla_attention,
)


def qkv(b=2, t=16, h=4, kv=2, d=8, seed=0):
    kq, kk, kv_ = jax.random.split(jax.random.key(seed), 3)
    return (
        jax.random.normal(kq, (b, t, h, d)),
        jax.random.normal(kk, (b, t, kv, d)),
        jax.random.normal(kv_, (b, t, kv, d)),
    )


def masks(b=2, t=16):
    pos = jnp.broadcast_to(jnp.arange(t), (b, t))
    seg = jnp.broadcast_to((jnp.arange(t) >= t // 3).astype(jnp.int32) + 1, (b, t))
    return {
        "causal": causal_mask(pos),
        "bidirectional": AttentionMask(q_positions=pos, kv_positions=pos, causal=False),
        "window": causal_mask(pos, sliding_window=4),
        "segments": causal_mask(pos, seg),
    }


@pytest.mark.parametrize("mask_name", ["causal", "bidirectional", "window", "segments"])
@pytest.mark.parametrize(("h", "kv"), [(4, 4), (4, 2), (4, 1)])
def test_xla_matches_naive_values_and_grads(mask_name, h, kv):
    q, k, v = qkv(h=h, kv=kv)
    mask = masks()[mask_name]
    np.testing.assert_allclose(
        xla_attention(q, k, v, mask), naive_attention(q, k, v, mask), rtol=1e-5, atol=1e-5
    )

    def loss(kernel):
        return lambda q, k, v: jnp.sum(jnp.sin(kernel(q, k, v, mask)))

    # Each gradient as one program, not op by op.
    got = jax.jit(jax.grad(loss(xla_attention), argnums=(0, 1, 2)))(q, k, v)
    want = jax.jit(jax.grad(loss(naive_attention), argnums=(0, 1, 2)))(q, k, v)
    for g, w in zip(got, want, strict=True):
        np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-5)


def test_naive_window_matches_explicit_mask():
    mask = masks(b=1, t=6)["window"].dense()[0]
    i, j = np.meshgrid(np.arange(6), np.arange(6), indexing="ij")
    np.testing.assert_array_equal(mask, (j <= i) & (i - j < 4))


def test_unknown_kernel_is_an_error():
    with pytest.raises(ValueError, match="unknown attention kernel 'fast'"):
        kernel_named("fast")


def test_kernels_by_name_are_the_objects():
    assert [kernel_named(n) for n in ("naive", "xla", "flash")] == [Naive(), Xla(), Flash()]
    assert hash(Flash()) == hash(Flash())  # static under jit
