"""XLA's fused attention through `jax.nn.dot_product_attention` (cuDNN-capable on GPU)."""

import jax
from jaxtyping import Array, Float

from layers.kernels.mask import AttentionMask


def xla_attention(
    q: Float[Array, "batch seq heads head_dim"],
    k: Float[Array, "batch kv_seq kv_heads head_dim"],
    v: Float[Array, "batch kv_seq kv_heads head_dim"],
    mask: AttentionMask,
) -> Float[Array, "batch seq heads head_dim"]:
    """Same contract as `naive_attention`; GQA is native (query heads a multiple of K/V heads)."""
    return jax.nn.dot_product_attention(q, k, v, mask=mask.dense()[:, None], implementation="xla")
