"""The XLA path of paged attention: gather each row's pages into a contiguous view, then masked
attention in float32 (the same einsums as `naive_attention`). Works on every backend and for
any number of query tokens (decode steps and prefill chunks alike).

It reads `row_pages * page_size` keys per row whatever the row's length, and materialises the
gathered view: simple and general, not the fast decode path (that is `decode.py` on GPU).
"""

import math

import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from layers.kernels.naive import soft_cap
from layers.kernels.paged.pages import visible


def gather_attention(
    q: Float[Array, "batch seq heads head_dim"],
    k_pages: Float[Array, "kv_heads pages page_size head_dim"],
    v_pages: Float[Array, "kv_heads pages page_size head_dim"],
    page_table: Int[Array, "batch row_pages"],
    lengths: Int[Array, " batch"],
    q_positions: Int[Array, "batch seq"],
    sliding_window: Int[Array, ""] | int | None,
    softcap: float | None = None,
) -> Float[Array, "batch seq heads head_dim"]:
    """softmax(softcap(q k^T / sqrt(d)) + mask) v over each row's pages; a query that sees no key
    outputs 0."""
    b, t, n_heads, d = q.shape
    n_kv, _, page_size, _ = k_pages.shape
    kv_seq = page_table.shape[1] * page_size

    def contiguous(pages):  # [kv_heads, batch, row_pages, page_size, d] -> [.., kv_seq, d]
        return pages[:, page_table].reshape(n_kv, b, kv_seq, d).astype(jnp.float32)

    qg = q.reshape(b, t, n_kv, n_heads // n_kv, d).astype(jnp.float32)
    scores = jnp.einsum("btkgd,kbsd->bkgts", qg, contiguous(k_pages)) / math.sqrt(d)
    scores = soft_cap(scores, softcap)
    allowed = visible(
        q_positions[:, :, None], jnp.arange(kv_seq)[None, None, :], lengths[:, None, None],
        sliding_window,
    )[:, None, None]  # fmt: skip
    scores = jnp.where(allowed, scores, -jnp.inf)
    # A row with nothing visible has max -inf: shift by 0 instead, so its weights are all 0.
    top = jnp.max(scores, axis=-1, keepdims=True)
    weights = jnp.exp(scores - jnp.where(jnp.isfinite(top), top, 0.0))
    denom = weights.sum(axis=-1)
    out = jnp.einsum("bkgts,kbsd->btkgd", weights, contiguous(v_pages))
    out = out / jnp.where(denom > 0, denom, 1.0).transpose(0, 3, 1, 2)[..., None]
    return out.reshape(b, t, n_heads, d).astype(q.dtype)
