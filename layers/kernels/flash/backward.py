"""Backward kernels (FlashAttention-2, Dao 2023, algorithm 2), recomputing each tile's
probabilities from the saved log-sum-exp instead of storing the [seq, kv_seq] matrix:

    P = exp2(S - lse),  dV = P^T dO,  dP = dO V^T,  dS = P * (dP - delta),
    dK = dS^T Q / sqrt(d),  dQ = dS K / sqrt(d),  with delta = rowsum(dO * O).

Two kernels, so that no two programs write the same output (no atomics):
- dK/dV: one program per (key tile, batch, K/V head) walks the visible query tiles of every
  query head in its group, so GQA/MQA gradients are summed in registers, not in a copy of K/V;
- dQ: one program per (query tile, batch, query head) walks the visible key tiles.
"""

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from layers.kernels.flash.config import Plan
from layers.kernels.flash.forward import compiler_params, dot_nn, dot_nt, dot_tn, log2_scores
from layers.kernels.flash.tiles import walk_tiles


def _dkv_kernel(
    lo_ref, full_lo_ref, full_hi_ref, hi_ref, q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref,
    q_pos_ref, kv_pos_ref, q_seg_ref, kv_seg_ref, dk_ref, dv_ref, *, plan: Plan,
):  # fmt: skip
    k, v = k_ref[...], v_ref[...]  # [block_k, head_dim]
    kv_pos = kv_pos_ref[...]
    kv_seg = None if kv_seg_ref is None else kv_seg_ref[...]
    bq = plan.backward_block_q

    def head(hh, carry):
        def step(i, carry, masked):
            dk, dv = carry
            rows = pl.ds(pl.multiple_of(i * bq, bq), bq)
            q, do = q_ref[rows, hh, :], do_ref[rows, hh, :]
            q_seg = None if q_seg_ref is None else q_seg_ref[rows]
            s = log2_scores(q, k, q_pos_ref[rows], kv_pos, q_seg, kv_seg, plan, masked)
            p = jnp.exp2(s - lse_ref[hh, rows][:, None])
            dv = dv + dot_tn(p.astype(do.dtype), do)
            ds = p * (dot_nt(do, v) - delta_ref[hh, rows][:, None])
            dk = dk + dot_tn(ds.astype(q.dtype), q)
            return dk, dv

        return walk_tiles((lo_ref, full_lo_ref, full_hi_ref, hi_ref), step, carry)

    zeros = jnp.zeros(k.shape, jnp.float32)
    dk, dv = jax.lax.fori_loop(0, plan.group, head, (zeros, zeros))
    dk_ref[...] = (dk * plan.scale).astype(dk_ref.dtype)
    dv_ref[...] = dv.astype(dv_ref.dtype)


def _dq_kernel(
    lo_ref, full_lo_ref, full_hi_ref, hi_ref, q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref,
    q_pos_ref, kv_pos_ref, q_seg_ref, kv_seg_ref, dq_ref, *, plan: Plan,
):  # fmt: skip
    q, do = q_ref[...], do_ref[...]  # [block_q, head_dim]
    lse, delta = lse_ref[...], delta_ref[...]
    q_pos = q_pos_ref[...]
    q_seg = None if q_seg_ref is None else q_seg_ref[...]
    bk = plan.backward_block_k

    def step(j, dq, masked):
        keys = pl.ds(pl.multiple_of(j * bk, bk), bk)
        k, v = k_ref[keys, :], v_ref[keys, :]
        kv_seg = None if kv_seg_ref is None else kv_seg_ref[keys]
        s = log2_scores(q, k, q_pos, kv_pos_ref[keys], q_seg, kv_seg, plan, masked)
        p = jnp.exp2(s - lse[:, None])
        ds = p * (dot_nt(do, v) - delta[:, None])
        return dq + dot_nn(ds.astype(k.dtype), k)

    dq = walk_tiles(
        (lo_ref, full_lo_ref, full_hi_ref, hi_ref), step, jnp.zeros(q.shape, jnp.float32)
    )
    dq_ref[...] = (dq * plan.scale).astype(dq_ref.dtype)


def flash_backward(q, k, v, out, lse, d_out, q_pos, kv_pos, q_seg, kv_seg, ranges, plan: Plan):
    """(dq, dk, dv) for `flash_forward`'s output `out` and its base-2 log-sum-exp `lse`."""
    b, t, h, d = q.shape
    s_len, n_kv = k.shape[1], k.shape[2]
    bq, bk, g = plan.backward_block_q, plan.backward_block_k, plan.group
    has_seg = q_seg is not None
    # delta = rowsum(dO * O): one elementwise product and a reduction, left to XLA to fuse.
    delta = jnp.einsum("bthd,bthd->bht", d_out.astype(jnp.float32), out.astype(jnp.float32))
    args = (q, k, v, d_out, lse, delta, q_pos, kv_pos, q_seg, kv_seg)

    # dK/dV: grid over (key tile, batch, K/V head); the query heads hh of K/V head kh are
    # kh*g .. kh*g+g-1, taken as one block of g heads.
    per_k_tile = pl.BlockSpec((None, None), lambda j, bi, kh: (bi, j))
    q_group = pl.BlockSpec((None, t, g, d), lambda j, bi, kh: (bi, 0, kh, 0))
    kv_tile = pl.BlockSpec((None, bk, None, d), lambda j, bi, kh: (bi, j, kh, 0))
    stats_group = pl.BlockSpec((None, g, t), lambda j, bi, kh: (bi, kh, 0))
    q_rows = pl.BlockSpec((None, t), lambda j, bi, kh: (bi, 0))
    kv_rows = pl.BlockSpec((None, bk), lambda j, bi, kh: (bi, j))
    dk, dv = pl.pallas_call(
        functools.partial(_dkv_kernel, plan=plan),
        grid=(s_len // bk, b, n_kv),
        in_specs=[
            *[per_k_tile] * 4,
            q_group,
            kv_tile,
            kv_tile,
            q_group,
            stats_group,
            stats_group,
            q_rows,
            kv_rows,
            q_rows if has_seg else None,
            kv_rows if has_seg else None,
        ],
        out_specs=[kv_tile, kv_tile],
        out_shape=[jax.ShapeDtypeStruct(k.shape, k.dtype), jax.ShapeDtypeStruct(v.shape, v.dtype)],
        compiler_params=compiler_params(plan),
        interpret=plan.interpret,
        name="flash_backward_dkv",
    )(*ranges["q"], *args)

    # dQ: grid over (query tile, batch, query head), like the forward.
    per_q_tile = pl.BlockSpec((None, None), lambda i, bi, hh: (bi, i))
    q_tile = pl.BlockSpec((None, bq, None, d), lambda i, bi, hh: (bi, i, hh, 0))
    kv_all = pl.BlockSpec((None, s_len, None, d), lambda i, bi, hh: (bi, 0, hh // g, 0))
    stats_tile = pl.BlockSpec((None, None, bq), lambda i, bi, hh: (bi, hh, i))
    q_rows = pl.BlockSpec((None, bq), lambda i, bi, hh: (bi, i))
    kv_rows = pl.BlockSpec((None, s_len), lambda i, bi, hh: (bi, 0))
    dq = pl.pallas_call(
        functools.partial(_dq_kernel, plan=plan),
        grid=(t // bq, b, h),
        in_specs=[
            *[per_q_tile] * 4,
            q_tile,
            kv_all,
            kv_all,
            q_tile,
            stats_tile,
            stats_tile,
            q_rows,
            kv_rows,
            q_rows if has_seg else None,
            kv_rows if has_seg else None,
        ],
        out_specs=q_tile,
        out_shape=jax.ShapeDtypeStruct(q.shape, q.dtype),
        compiler_params=compiler_params(plan),
        interpret=plan.interpret,
        name="flash_backward_dq",
    )(*ranges["kv"], *args)
    return dq, dk, dv
