"""The XLA path of paged attention: each group of queries walks its row's pages a block at a time
with an online softmax (Milakov & Gimelshein 2018, as in FlashAttention), reading only the blocks
that hold a key some query of the call can see.

The walk is a `lax.fori_loop` whose bounds are data (the longest row's last visible key, and the
earliest key a sliding window still shows), so the work follows the tokens the rows hold, never
the page table's width (`max_len`), and new lengths never recompile anything. Every group walks
the same blocks: a short row's blocks past its length are masked, so a step costs the longest
row's keys times the number of groups.

A decode step (one query per group) and a chunk of prompt tokens (several queries per group, whose
own keys are already in the pages) are the same call; the pools may carry a leading stacked-layers
axis (`layer` picks one, read through the gather, never sliced out whole). int8 pools (int8.py)
are read as their numbers; the keys' scales multiply the scores and the values' scales the
softmax weights, which is attention over the dequantized pool without ever writing it out.
"""

import math

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from layers.kernels.naive import soft_cap
from layers.kernels.paged.int8 import Int8Pages
from layers.kernels.paged.pages import Pool, visible


def _block_bounds(q_positions, lengths, window, block: int) -> tuple[Array, Array]:
    """[lo, hi): the blocks holding a key some query sees (queries at negative positions see
    nothing: padding and idle groups)."""
    real = q_positions >= 0
    end = jnp.minimum(q_positions + 1, lengths[:, None])  # past each query's last visible key
    hi = -(-jnp.max(jnp.where(real, end, 0)) // block)
    if window is None:
        return jnp.zeros((), jnp.int32), hi
    first = jnp.maximum(q_positions - window + 1, 0)
    lo = jnp.min(jnp.where(real, first, jnp.iinfo(jnp.int32).max)) // block
    return jnp.minimum(lo, hi), hi


def blocked_attention(
    q: Float[Array, "groups seq heads head_dim"],
    k_pages: Pool,
    v_pages: Pool | None,
    page_table: Int[Array, "groups row_pages"],
    lengths: Int[Array, " groups"],
    q_positions: Int[Array, "groups seq"],
    sliding_window: Int[Array, ""] | int | None,
    softcap: float | None,
    *,
    keys_per_block: int,
    layer: Int[Array, ""] | None = None,
) -> Float[Array, "groups seq heads head_dim"]:
    """softmax(softcap(q k^T / sqrt(d)) + mask) v over each group's pages, the visibility rule of
    `pages.visible`; a query that sees no key outputs 0. `v_pages=None`: the values are the keys
    (MLA's latent cache). `layer` indexes the pools' leading stacked axis (None: no such axis).
    """
    g, s, n_heads, d = q.shape
    n_kv, page_size = k_pages.shape[-4], k_pages.shape[-2]
    block_pages = max(1, keys_per_block // page_size)
    block = block_pages * page_size
    table = jnp.pad(page_table, ((0, 0), (0, -page_table.shape[1] % block_pages)))
    # A row holds at most its table's slots: keys past them do not exist.
    lengths = jnp.minimum(lengths, page_table.shape[1] * page_size)
    qg = q.reshape(g, s, n_kv, n_heads // n_kv, d).astype(jnp.float32) / math.sqrt(d)

    def gather(pool, pages):  # [kv_heads, groups, block, ...] in float32
        rows = pool[:, pages] if layer is None else pool[layer, :, pages]
        if layer is not None:  # the layer index apart from the pages puts [groups, ...] first
            rows = jnp.moveaxis(rows, 2, 0)
        return rows.reshape(n_kv, g, block, *rows.shape[4:]).astype(jnp.float32)

    def read(pool, pages):  # the numbers [kv, g, block, d]; int8: the scales [g, kv, 1, 1, block]
        if not isinstance(pool, Int8Pages):
            return gather(pool, pages), None
        scales = jnp.moveaxis(gather(pool.scales, pages), 1, 0)
        return gather(pool.values, pages), scales[:, :, None, None]

    def step(i, carry):
        top, denom, acc = carry  # [g, kv, group, s] twice, [g, kv, group, s, d]
        pages = jax.lax.dynamic_slice_in_dim(table, i * block_pages, block_pages, axis=1)
        k, k_scales = read(k_pages, pages)
        v, v_scales = (k, k_scales) if v_pages is None else read(v_pages, pages)
        scores = jnp.einsum("gskhd,kgtd->gkhst", qg, k)
        scores = soft_cap(scores if k_scales is None else scores * k_scales, softcap)
        key_pos = i * block + jnp.arange(block)
        seen = visible(
            q_positions[:, None, None, :, None], key_pos, lengths[:, None, None, None, None],
            sliding_window,
        )  # fmt: skip
        scores = jnp.where(seen, scores, -jnp.inf)
        new_top = jnp.maximum(top, scores.max(axis=-1))
        # Rows that have seen nothing yet keep a shift of 0 (their weights are all 0).
        shift = jnp.where(jnp.isfinite(new_top), new_top, 0.0)
        rescale = jnp.exp(top - shift)
        weights = jnp.exp(scores - shift[..., None])
        denom = rescale * denom + weights.sum(axis=-1)
        scaled = weights if v_scales is None else weights * v_scales
        acc = rescale[..., None] * acc + jnp.einsum("gkhst,kgtd->gkhsd", scaled, v)
        return new_top, denom, acc

    shape = (g, n_kv, n_heads // n_kv, s)
    init = (
        jnp.full(shape, -jnp.inf, jnp.float32),
        jnp.zeros(shape, jnp.float32),
        jnp.zeros((*shape, d), jnp.float32),
    )
    lo, hi = _block_bounds(q_positions, lengths, sliding_window, block)
    _, denom, acc = jax.lax.fori_loop(lo, hi, step, init)
    out = acc / jnp.where(denom > 0, denom, 1.0)[..., None]  # [g, kv, group, s, d]
    return jnp.moveaxis(out, 3, 1).reshape(g, s, n_heads, d).astype(q.dtype)
