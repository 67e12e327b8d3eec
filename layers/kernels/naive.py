"""The executable specification of attention: einsum, float32 softmax, einsum.

Materialises the [batch, heads, seq, kv_seq] score matrix; every other kernel is tested
against this one in values and gradients.
"""

import math

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float

from layers.kernels.mask import AttentionMask


def soft_cap(scores: Float[Array, "..."], cap: float | None) -> Float[Array, "..."]:
    """cap * tanh(scores / cap) (Gemma 2's logit soft-capping); the identity when cap is None."""
    return scores if cap is None else cap * jnp.tanh(scores / cap)


def naive_attention(
    q: Float[Array, "batch seq heads head_dim"],
    k: Float[Array, "batch kv_seq kv_heads head_dim"],
    v: Float[Array, "batch kv_seq kv_heads head_dim"],
    mask: AttentionMask,
    *,
    softcap: float | None = None,
) -> Float[Array, "batch seq heads head_dim"]:
    """softmax(softcap(q k^T / sqrt(d)) + mask) v, with K/V heads shared by groups of query heads
    (GQA); `softcap` (Gemma 2) squashes the scaled scores to cap * tanh(s / cap) before masking."""
    b, t, n_heads, d = q.shape
    n_kv = k.shape[2]
    qg = q.reshape(b, t, n_kv, n_heads // n_kv, d).astype(jnp.float32)
    scores = jnp.einsum("btkgd,bskd->bkgts", qg, k.astype(jnp.float32)) / math.sqrt(d)
    scores = soft_cap(scores, softcap)
    allowed = mask.dense()[:, None, None, :, :]
    scores = jnp.where(allowed, scores, jnp.finfo(jnp.float32).min)
    probs = jax.nn.softmax(scores, axis=-1)
    out = jnp.einsum("bkgts,bskd->btkgd", probs, v.astype(jnp.float32))
    return out.reshape(b, t, n_heads, d).astype(q.dtype)
