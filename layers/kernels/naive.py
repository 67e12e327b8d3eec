"""The executable specification of attention: einsum, float32 softmax, einsum.

Materialises the [batch, heads, seq, kv_seq] score matrix; every other kernel is tested
against this one in values and gradients.
"""

import math

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float

from layers.kernels.mask import AttentionMask


def naive_attention(
    q: Float[Array, "batch seq heads head_dim"],
    k: Float[Array, "batch kv_seq kv_heads head_dim"],
    v: Float[Array, "batch kv_seq kv_heads head_dim"],
    mask: AttentionMask,
) -> Float[Array, "batch seq heads head_dim"]:
    """softmax(q k^T / sqrt(d) + mask) v, with K/V heads shared by groups of query heads (GQA)."""
    b, t, n_heads, d = q.shape
    n_kv = k.shape[2]
    qg = q.reshape(b, t, n_kv, n_heads // n_kv, d).astype(jnp.float32)
    scores = jnp.einsum("btkgd,bskd->bkgts", qg, k.astype(jnp.float32)) / math.sqrt(d)
    allowed = mask.dense()[:, None, None, :, :]
    scores = jnp.where(allowed, scores, jnp.finfo(jnp.float32).min)
    probs = jax.nn.softmax(scores, axis=-1)
    out = jnp.einsum("bkgts,bskd->btkgd", probs, v.astype(jnp.float32))
    return out.reshape(b, t, n_heads, d).astype(q.dtype)
