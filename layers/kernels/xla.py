"""XLA's fused attention through `jax.nn.dot_product_attention` (cuDNN-capable on GPU)."""

import jax
from jaxtyping import Array, Float

from layers.kernels.mask import AttentionMask


def xla_attention(
    q: Float[Array, "batch seq heads head_dim"],
    k: Float[Array, "batch kv_seq kv_heads head_dim"],
    v: Float[Array, "batch kv_seq kv_heads head_dim"],
    mask: AttentionMask,
    *,
    softcap: float | None = None,
) -> Float[Array, "batch seq heads head_dim"]:
    """Same contract as `naive_attention`; GQA is native (query heads a multiple of K/V heads).
    `jax.nn.dot_product_attention` has no soft-capping: a `softcap` is refused, not ignored."""
    if softcap is not None:
        raise ValueError(
            f"attention='xla' cannot soft-cap attention scores (softcap={softcap}; "
            "jax.nn.dot_product_attention has no such option): use attention='flash' or 'naive'"
        )
    return jax.nn.dot_product_attention(q, k, v, mask=mask.dense()[:, None], implementation="xla")
