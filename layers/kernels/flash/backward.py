"""Backward kernels (FlashAttention-2, Dao 2023, algorithm 2), recomputing each tile's
probabilities from the saved log-sum-exp instead of storing the [seq, kv_seq] matrix. On the
transposed tile, with c = log2(e) / sqrt(d) and delta = rowsum(dO * O):

    S^T = K Q^T,  P^T = exp2(S^T c - lse),  dV += P^T dO,  dP^T = V dO^T,
    dS^T = P^T * (dP^T - delta),  dK += dS^T Q,  dQ += dS K,

and dK, dQ times 1/sqrt(d) once at the end. Five matmuls per tile pair, FA2's count. The dK/dV
kernel computes S^T = K Q^T rather than S = Q K^T: P^T and dS^T, the left operands of the dV and
dK products, then come out of their matmuls already in the orientation those products take, so
no tile is transposed in registers; only dS K, for dQ, reads dS^T transposed.

One program per (key tile, batch, K/V head) walks the visible query tiles of every query head in
its group, so GQA/MQA gradients of K and V are summed in registers, never in a copy of K/V, and
no two programs write the same dK/dV. dQ, by `BlockSizes.backward_dq`:
- "atomic": the same program adds each tile's dS K into a float32 dQ buffer with atomic adds
  (FA2's scheme): one kernel, 5 matmuls. On a GPU the additions land in a varying order, so
  dQ's last bits vary from run to run.
- "separate": a second kernel, one program per (query tile, batch, query head), recomputes S and
  dP and sums dQ in registers: 7 matmuls in all, bit-reproducible.
"""

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from layers.kernels.flash.config import Plan
from layers.kernels.flash.forward import (
    LOG2E,
    WINDOW_SPEC,
    compiler_params,
    dot_nn,
    dot_nt,
    dot_tn,
    heaviest_first,
    scores,
    softcap_slope,
)
from layers.kernels.flash.tiles import walk_tiles


def _dkv_kernel(
    lo_ref, full_lo_ref, full_hi_ref, hi_ref, q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref,
    q_pos_ref, kv_pos_ref, q_seg_ref, kv_seg_ref, window_ref, *out_refs, plan: Plan,
):  # fmt: skip
    # "atomic": the dQ buffer comes in aliased (its input ref, unused) and goes out as the third
    # output, the one the atomic adds target.
    dk_ref, dv_ref, *dq_ref = out_refs[1:] if plan.backward_dq == "atomic" else out_refs
    k, v = k_ref[...], v_ref[...]  # [block_k, head_dim]
    kv_pos = kv_pos_ref[...]
    kv_seg = None if kv_seg_ref is None else kv_seg_ref[...]
    window = None if window_ref is None else window_ref[...]
    bq, c = plan.backward_block_q, plan.scale * LOG2E

    def head(hh, carry):
        def step(i, carry, masked):
            dk, dv = carry
            rows = pl.ds(pl.multiple_of(i * bq, bq), bq)
            q, do = q_ref[rows, hh, :], do_ref[rows, hh, :]
            q_seg = None if q_seg_ref is None else q_seg_ref[rows]
            s_t = scores(k, q, q_pos_ref[rows], kv_pos, q_seg, kv_seg, window, plan, masked, True)
            p_t = jnp.exp2(s_t * c - lse_ref[hh, rows][None, :])  # [block_k, block_q]
            dv = dv + dot_nn(p_t.astype(do.dtype), do)
            ds_t = p_t * (dot_nt(v, do) - delta_ref[hh, rows][None, :])
            if plan.softcap is not None:
                ds_t = ds_t * softcap_slope(s_t, plan)
            ds_t = ds_t.astype(q.dtype)
            dk = dk + dot_nn(ds_t, q)
            if dq_ref:
                plgpu.atomic_add(dq_ref[0], (rows, hh, slice(None)), dot_tn(ds_t, k))
            return dk, dv

        return walk_tiles((lo_ref, full_lo_ref, full_hi_ref, hi_ref), step, carry)

    zeros = jnp.zeros(k.shape, jnp.float32)
    dk, dv = jax.lax.fori_loop(0, plan.group, head, (zeros, zeros))
    dk_ref[...] = (dk * plan.scale).astype(dk_ref.dtype)
    dv_ref[...] = dv.astype(dv_ref.dtype)


def _dq_kernel(
    lo_ref, full_lo_ref, full_hi_ref, hi_ref, q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref,
    q_pos_ref, kv_pos_ref, q_seg_ref, kv_seg_ref, window_ref, dq_ref, *, plan: Plan,
):  # fmt: skip
    q, do = q_ref[...], do_ref[...]  # [block_q, head_dim]
    window = None if window_ref is None else window_ref[...]
    lse, delta = lse_ref[...], delta_ref[...]
    q_pos = q_pos_ref[...]
    q_seg = None if q_seg_ref is None else q_seg_ref[...]
    bk, c = plan.backward_block_k, plan.scale * LOG2E

    def step(j, dq, masked):
        keys = pl.ds(pl.multiple_of(j * bk, bk), bk)
        k, v = k_ref[keys, :], v_ref[keys, :]
        kv_seg = None if kv_seg_ref is None else kv_seg_ref[keys]
        s = scores(q, k, q_pos, kv_pos_ref[keys], q_seg, kv_seg, window, plan, masked)
        p = jnp.exp2(s * c - lse[:, None])
        ds = p * (dot_nt(do, v) - delta[:, None])
        if plan.softcap is not None:
            ds = ds * softcap_slope(s, plan)
        return dq + dot_nn(ds.astype(k.dtype), k)

    dq = walk_tiles(
        (lo_ref, full_lo_ref, full_hi_ref, hi_ref), step, jnp.zeros(q.shape, jnp.float32)
    )
    dq_ref[...] = (dq * plan.scale).astype(dq_ref.dtype)


def flash_backward(
    q, k, v, out, lse, d_out, q_pos, kv_pos, q_seg, kv_seg, window, ranges, plan: Plan
):
    """(dq, dk, dv) for `flash_forward`'s output `out` and its base-2 log-sum-exp `lse`."""
    b, t, h, d = q.shape
    s_len, n_kv = k.shape[1], k.shape[2]
    bq, bk, g = plan.backward_block_q, plan.backward_block_k, plan.group
    has_seg = q_seg is not None
    atomic = plan.backward_dq == "atomic"
    # delta = rowsum(dO * O): a product and a row sum, which XLA fuses into one pass.
    delta = jnp.sum(d_out.astype(jnp.float32) * out.astype(jnp.float32), axis=-1)
    args = (q, k, v, d_out, lse, delta.transpose(0, 2, 1), q_pos, kv_pos, q_seg, kv_seg, window)
    window_spec = None if window is None else WINDOW_SPEC

    # dK/dV(/dQ): grid over (key tile, batch, K/V head); the query heads hh of K/V head kh are
    # kh*g .. kh*g+g-1, taken as one block of g heads. Under a causal mask the first key tile is
    # seen by every query tile: grid order is already heaviest first.
    per_k_tile = pl.BlockSpec((None, None), lambda j, bi, kh: (bi, j))
    q_group = pl.BlockSpec((None, t, g, d), lambda j, bi, kh: (bi, 0, kh, 0))
    kv_tile = pl.BlockSpec((None, bk, None, d), lambda j, bi, kh: (bi, j, kh, 0))
    stats_group = pl.BlockSpec((None, g, t), lambda j, bi, kh: (bi, kh, 0))
    q_rows = pl.BlockSpec((None, t), lambda j, bi, kh: (bi, 0))
    kv_rows = pl.BlockSpec((None, bk), lambda j, bi, kh: (bi, j))
    in_specs = [
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
        window_spec,
    ]
    out_specs = [kv_tile, kv_tile]
    out_shape = [jax.ShapeDtypeStruct(k.shape, k.dtype), jax.ShapeDtypeStruct(v.shape, v.dtype)]
    inputs = (*ranges["q"], *args)
    aliases = {}
    if atomic:  # a zeroed float32 dQ buffer, passed in and aliased to the third output
        aliases = {len(jax.tree.leaves(inputs)): 2}
        inputs = (*inputs, jnp.zeros(q.shape, jnp.float32))
        in_specs.append(q_group)
        out_specs.append(q_group)
        out_shape.append(jax.ShapeDtypeStruct(q.shape, jnp.float32))
    grads = pl.pallas_call(
        functools.partial(_dkv_kernel, plan=plan),
        grid=(s_len // bk, b, n_kv),
        in_specs=in_specs,
        out_specs=out_specs,
        out_shape=out_shape,
        input_output_aliases=aliases,
        compiler_params=compiler_params(plan),
        interpret=plan.interpret,
        name="flash_backward" if atomic else "flash_backward_dkv",
    )(*inputs)
    if atomic:
        dk, dv, dq = grads
        return (dq * plan.scale).astype(q.dtype), dk, dv
    dk, dv = grads

    # dQ: grid over (query tile, batch, query head), heaviest first like the forward.
    tile = heaviest_first(t // bq)
    per_q_tile = pl.BlockSpec((None, None), lambda i, bi, hh: (bi, tile(i)))
    q_tile = pl.BlockSpec((None, bq, None, d), lambda i, bi, hh: (bi, tile(i), hh, 0))
    kv_all = pl.BlockSpec((None, s_len, None, d), lambda i, bi, hh: (bi, 0, hh // g, 0))
    stats_tile = pl.BlockSpec((None, None, bq), lambda i, bi, hh: (bi, hh, tile(i)))
    q_rows = pl.BlockSpec((None, bq), lambda i, bi, hh: (bi, tile(i)))
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
            window_spec,
        ],
        out_specs=q_tile,
        out_shape=jax.ShapeDtypeStruct(q.shape, q.dtype),
        compiler_params=compiler_params(plan),
        interpret=plan.interpret,
        name="flash_backward_dq",
    )(*ranges["kv"], *args)
    return dq, dk, dv
