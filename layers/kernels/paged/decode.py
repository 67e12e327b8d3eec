"""The Pallas paged decode kernel (GPU, through Triton; the Pallas interpreter on CPU): one query
token per row attends over the row's pages, read through its page table.

Grid (batch, kv_heads, splits). One program owns one row, one K/V head and the whole GQA group
of query heads that share it, so each page is read from memory once for the group. It walks the
blocks of `pages_per_block` pages that hold visible keys (the sliding window and the row's
length bound the walk; pages outside it are never read), gathers each block's pages through the
page table and keeps an online softmax (running max, denominator and unnormalised output;
Milakov & Gimelshein 2018, as in FlashAttention-2). With `splits` > 1 the row's blocks are
divided among that many programs (Flash-Decoding, Dao et al. 2023), so a small batch still fills
the GPU, and XLA merges their partial results by their maxima and denominators.

Triton's matrix product needs every side >= 16, so the group of query heads is padded with zero
rows to `max(16, next power of two)`: decode is bound by reading the pages, not by these
products. Exponentials are base 2 (`exp2`), as in the flash kernel.

int8 pools (int8.py) come with their scales, gathered through the same table: a block's int8
numbers are converted to the query's dtype (exact: |n| <= 127), the keys' scales multiply the
scores and the values' scales the weights, so the block is never dequantized in memory.
"""

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu
from jaxtyping import Array, Float, Int

from layers.kernels.flash.forward import LOG2E, MASKED, dot_nn, dot_nt
from layers.kernels.paged.int8 import Int8Pages
from layers.kernels.paged.pages import Pool, visible


@dataclasses.dataclass(frozen=True, kw_only=True)
class DecodePlan:
    """Everything static about one call of the kernel."""

    windowed: bool  # the window itself is data: a per-row input of the kernel
    softcap: float | None  # scaled scores -> softcap * tanh(s / softcap) (Gemma 2)
    scale: float
    pages_per_block: int
    splits: int
    num_warps: int
    num_stages: int
    interpret: bool


def _decode_kernel(
    lengths_ref, q_pos_ref, window_ref, table_ref, q_ref, k_ref, v_ref, k_scale_ref, v_scale_ref,
    o_ref, m_ref, l_ref, *, plan: DecodePlan,
):  # fmt: skip
    # q_ref [group_pad, head_dim]; k_ref, v_ref [pages, page_size, head_dim] (this K/V head's
    # pool); k_scale_ref, v_scale_ref [pages, page_size] (int8 pools) or None; table_ref
    # [row_pages] (this row's table, padded to whole blocks).
    length, q_pos = lengths_ref[...], q_pos_ref[...]
    window = None if window_ref is None else window_ref[...]
    group_pad, head_dim = q_ref.shape
    ppb = plan.pages_per_block
    block = ppb * k_ref.shape[1]
    # Visible keys are the positions [first, end): one contiguous run.
    first = 0 if window is None else jnp.maximum(q_pos - window + 1, 0)
    end = jnp.minimum(q_pos + 1, length)
    lo = first // block
    hi = jnp.where(end > first, (end + block - 1) // block, lo)
    # This program's share of the blocks [lo, hi): every block it visits holds a visible key.
    share = (hi - lo + plan.splits - 1) // plan.splits
    start = jnp.minimum(lo + pl.program_id(2) * share, hi)
    stop = jnp.minimum(start + share, hi)

    q = q_ref[...]

    def step(i, carry):
        o, m, denom = carry
        pages = table_ref[pl.ds(pl.multiple_of(i * ppb, ppb), ppb)]
        k = k_ref[pages].reshape(block, head_dim).astype(q.dtype)
        v = v_ref[pages].reshape(block, head_dim).astype(q.dtype)
        s = dot_nt(q, k)
        if k_scale_ref is not None:
            s = s * k_scale_ref[pages].reshape(1, block).astype(jnp.float32)
        if plan.softcap is None:
            s = s * (plan.scale * LOG2E)
        else:
            s = plan.softcap * jnp.tanh(s * (plan.scale / plan.softcap)) * LOG2E
        key_pos = i * block + jax.lax.broadcasted_iota(jnp.int32, (1, block), 1)
        s = jnp.where(visible(q_pos, key_pos, length, window), s, MASKED)
        m_new = jnp.maximum(m, s.max(axis=-1))
        rescale = jnp.exp2(m - m_new)
        p = jnp.exp2(s - m_new[:, None])
        denom = rescale * denom + p.sum(axis=-1)
        if v_scale_ref is not None:
            p = p * v_scale_ref[pages].reshape(1, block).astype(jnp.float32)
        o = rescale[:, None] * o + dot_nn(p.astype(v.dtype), v)
        return o, m_new, denom

    init = (
        jnp.zeros((group_pad, head_dim), jnp.float32),
        jnp.full((group_pad,), -jnp.inf, jnp.float32),
        jnp.zeros((group_pad,), jnp.float32),
    )
    o, m, denom = jax.lax.fori_loop(start, stop, step, init)
    o_ref[...], m_ref[...], l_ref[...] = o, m, denom


def _merge(o, m, denom):
    """Combine the splits' partial results [splits, ...]: weight each by 2^(m - max m). A split
    that saw nothing has denom 0 and m -inf; a row that saw nothing outputs 0."""
    top = jnp.max(m, axis=0)
    weight = jnp.exp2(m - jnp.where(jnp.isfinite(top), top, 0.0))
    num = jnp.sum(weight[..., None] * o, axis=0)
    den = jnp.sum(weight * denom, axis=0)
    return num / jnp.where(den > 0, den, 1.0)[..., None]


def paged_decode(
    q: Float[Array, "batch 1 heads head_dim"],
    k_pages: Pool,
    v_pages: Pool,
    page_table: Int[Array, "batch row_pages"],
    lengths: Int[Array, " batch"],
    q_positions: Int[Array, "batch 1"],
    window: Int[Array, " batch"] | None,
    plan: DecodePlan,
) -> Float[Array, "batch 1 heads head_dim"]:
    """One decode step of paged attention (inputs already checked by `paged_attention`)."""
    b, _, n_heads, d = q.shape
    n_kv, n_pages, page_size, _ = k_pages.shape
    group = n_heads // n_kv
    group_pad = max(16, 1 << (group - 1).bit_length())
    qg = q.reshape(b, n_kv, group, d)
    qg = jnp.pad(qg, ((0, 0), (0, 0), (0, group_pad - group), (0, 0)))
    ppb, splits = plan.pages_per_block, plan.splits
    # A row holds at most its table's slots: keys past them do not exist (as in the XLA path).
    lengths = jnp.minimum(lengths.astype(jnp.int32), page_table.shape[1] * page_size)
    table = page_table.astype(jnp.int32)
    table = jnp.pad(table, ((0, 0), (0, -table.shape[1] % ppb)))  # whole blocks; page 0 is valid

    per_row = pl.BlockSpec((None,), lambda bi, h, s: (bi,))
    pool = pl.BlockSpec((None, n_pages, page_size, d), lambda bi, h, s: (h, 0, 0, 0))
    int8 = isinstance(k_pages, Int8Pages)
    scales = pl.BlockSpec((None, n_pages, page_size), lambda bi, h, s: (h, 0, 0)) if int8 else None
    group_block = pl.BlockSpec((None, None, group_pad, d), lambda bi, h, s: (bi, h, 0, 0))
    stats = pl.BlockSpec((None, None, None, group_pad), lambda bi, h, s: (s, bi, h, 0))
    partial = (splits, b, n_kv, group_pad)
    o, m, denom = pl.pallas_call(
        functools.partial(_decode_kernel, plan=plan),
        grid=(b, n_kv, splits),
        in_specs=[
            per_row,
            per_row,
            None if window is None else per_row,
            pl.BlockSpec((None, table.shape[1]), lambda bi, h, s: (bi, 0)),
            group_block,
            pool,
            pool,
            scales,
            scales,
        ],
        out_specs=[
            pl.BlockSpec((None, None, None, group_pad, d), lambda bi, h, s: (s, bi, h, 0, 0)),
            stats,
            stats,
        ],
        out_shape=[
            jax.ShapeDtypeStruct((*partial, d), jnp.float32),
            jax.ShapeDtypeStruct(partial, jnp.float32),
            jax.ShapeDtypeStruct(partial, jnp.float32),
        ],
        compiler_params=plgpu.CompilerParams(num_warps=plan.num_warps, num_stages=plan.num_stages),
        interpret=plan.interpret,
        name="paged_decode",
    )(
        lengths, q_positions[:, 0].astype(jnp.int32), window, table, qg,
        *((k_pages.values, v_pages.values, k_pages.scales, v_pages.scales) if int8
          else (k_pages, v_pages, None, None)),
    )  # fmt: skip
    out = _merge(o, m, denom)[:, :, :group]  # [batch, kv_heads, group, head_dim]
    return out.reshape(b, 1, n_heads, d).astype(q.dtype)


def default_splits(batch: int, kv_heads: int, blocks: int) -> int:
    """Enough programs to fill a GPU: about 128 in all (one per SM of an H100), at most 16 splits
    and at most one per block of keys."""
    return max(1, min(16, blocks, math.ceil(128 / (batch * kv_heads))))
