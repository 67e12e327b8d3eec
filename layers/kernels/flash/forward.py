"""Forward kernel (FlashAttention-2, Dao 2023, algorithm 1): one program per (query tile, batch,
head) keeps a running max `m`, a running denominator and an unnormalised output for its
`block_q` rows while walking the visible key tiles, then writes the output and the log-sum-exp
that the backward kernels reuse.

Exponentials are base 2 (`exp2`, the GPU's native instruction) with c = log2(e) / sqrt(head_dim):
p = exp2(s * c - m * c) on the raw scores s = q k^T, so the softmax scale costs no instruction of
its own (it is the multiply of the fused multiply-add that subtracts the max, as in FA2's CUDA
kernel), and the saved log-sum-exp is in base-2 units of the scaled scores. Folding c into q
once instead would round q * c to bfloat16: several times larger output errors on peaked
attention (bench/RESULTS.md has the measurement).

Query tiles run heaviest first: under a causal mask the last query tile sees every key tile and
the first only one, and a GPU starts programs in grid order, so the long ones start first and the
short ones fill the tail (FA2's and FA3's schedulers do the same).
"""

import functools
import math

import jax
import jax.experimental.pallas.tpu  # registers config flags early: see below
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from layers.kernels.flash.config import Plan
from layers.kernels.flash.tiles import element_mask, walk_tiles

# The import of pallas.tpu above registers config flags that the Pallas interpreter would otherwise
# register in the middle of the first trace; that changes jit's tracing context, so every jitted
# caller (a whole training step) would compile twice on CPU.

LOG2E = math.log2(math.e)
# Finite stand-in for -inf in masked scores: exp2((MASKED - m) * c) is 0 once any real score is
# seen, and a masked-only tile never produces inf - inf = NaN.
MASKED = -0.7 * float(jnp.finfo(jnp.float32).max)


def _dot(a: jax.Array, b: jax.Array, contract: tuple[int, int]) -> jax.Array:
    """A tile product with float32 accumulation. float32 operands get full float32 products:
    Triton's default on a GPU is TF32 (10 mantissa bits, ~1e-3 relative error per product)."""
    precision = jax.lax.Precision.HIGHEST if a.dtype == jnp.float32 else None
    dims = (((contract[0],), (contract[1],)), ((), ()))
    return jax.lax.dot_general(a, b, dims, precision=precision, preferred_element_type=jnp.float32)


def dot_nt(a: jax.Array, b: jax.Array) -> jax.Array:
    """a @ b.T with float32 accumulation."""
    return _dot(a, b, (1, 1))


def dot_tn(a: jax.Array, b: jax.Array) -> jax.Array:
    """a.T @ b with float32 accumulation."""
    return _dot(a, b, (0, 0))


def dot_nn(a: jax.Array, b: jax.Array) -> jax.Array:
    """a @ b with float32 accumulation."""
    return _dot(a, b, (1, 0))


def scores(
    a, b, q_pos, kv_pos, q_seg, kv_seg, window, plan: Plan, masked: bool, transposed: bool = False
) -> jax.Array:
    """Raw scores a b^T of one tile, soft-capped if the plan says so, masked (to MASKED) if
    `masked`: a = q, b = k gives S [block_q, block_k]; a = k, b = q with `transposed` gives S^T
    [block_k, block_q]. `window`: the sliding window (a [1] array) or None.

    Soft-capping keeps the scores in raw units (before the 1/sqrt(d) scale), so the rest of the
    kernel is unchanged: s -> (cap / scale) tanh(s scale / cap), whose scaled value is
    cap tanh(s scale / cap). Its derivative is 1 - tanh^2 (`softcap_slope`)."""
    s = dot_nt(a, b)
    if plan.softcap is not None:
        s = (plan.softcap / plan.scale) * jnp.tanh(s * (plan.scale / plan.softcap))
    if not masked:
        return s
    allowed = element_mask(
        q_pos, kv_pos, q_seg, kv_seg, causal=plan.causal, window=window, transposed=transposed
    )
    return s if allowed is None else jnp.where(allowed, s, MASKED)


def softcap_slope(s: jax.Array, plan: Plan) -> jax.Array:
    """d(capped s) / d(raw s) = 1 - tanh^2 from the capped scores `scores` returns; 0 where
    they are MASKED (their probabilities are 0 anyway: this keeps 0 * inf out)."""
    t = s * (plan.scale / plan.softcap)
    return 1.0 - jnp.minimum(t * t, 1.0)


# The sliding window: one int32 in a [1] array, the same block for every program.
WINDOW_SPEC = pl.BlockSpec((1,), lambda *_: (0,))


def heaviest_first(n_tiles: int):
    """Grid index -> tile index, last tile first (see the module docstring)."""
    return lambda i: n_tiles - 1 - i


def _forward_kernel(
    lo_ref, full_lo_ref, full_hi_ref, hi_ref, q_ref, k_ref, v_ref,
    q_pos_ref, kv_pos_ref, q_seg_ref, kv_seg_ref, window_ref, o_ref, lse_ref, *, plan: Plan,
):  # fmt: skip
    q = q_ref[...]  # [block_q, head_dim]
    window = None if window_ref is None else window_ref[...]
    q_pos = q_pos_ref[...]
    q_seg = None if q_seg_ref is None else q_seg_ref[...]
    block_q, head_dim = q.shape
    bk, c = plan.block_k, plan.scale * LOG2E

    def step(j, carry, masked):
        o, m, denom = carry  # m: running max of the raw scores
        keys = pl.ds(pl.multiple_of(j * bk, bk), bk)
        kv_seg = None if kv_seg_ref is None else kv_seg_ref[keys]
        s = scores(q, k_ref[keys, :], q_pos, kv_pos_ref[keys], q_seg, kv_seg, window, plan, masked)
        m_new = jnp.maximum(m, s.max(axis=-1))
        rescale = jnp.exp2((m - m_new) * c)
        p = jnp.exp2(s * c - (m_new * c)[:, None])
        denom = rescale * denom + p.sum(axis=-1)
        v = v_ref[keys, :]
        o = rescale[:, None] * o + dot_nn(p.astype(v.dtype), v)
        return o, m_new, denom

    init = (
        jnp.zeros((block_q, head_dim), jnp.float32),
        jnp.full((block_q,), -jnp.inf, jnp.float32),
        jnp.zeros((block_q,), jnp.float32),
    )
    o, m, denom = walk_tiles((lo_ref, full_lo_ref, full_hi_ref, hi_ref), step, init)
    # A row that saw no key tile at all (nothing visible) outputs 0 and a huge log-sum-exp, so
    # its backward probabilities are 0 rather than NaN.
    seen = denom > 0
    denom = jnp.where(seen, denom, 1.0)
    o_ref[...] = (o / denom[:, None]).astype(o_ref.dtype)
    lse_ref[...] = jnp.where(seen, m * c + jnp.log2(denom), -MASKED)


def compiler_params(plan: Plan) -> plgpu.CompilerParams:
    """Triton launch settings, passed explicitly so that JAX 0.11 (which would otherwise lower a
    bare pallas_call to Mosaic GPU) and 0.12 (Triton only) both compile through Triton."""
    return plgpu.CompilerParams(num_warps=plan.num_warps, num_stages=plan.num_stages)


def flash_forward(q, k, v, q_pos, kv_pos, q_seg, kv_seg, window, ranges, plan: Plan):
    """out [batch, seq, heads, head_dim] and base-2 log-sum-exp [batch, heads, seq] (float32)."""
    b, t, h, d = q.shape
    s_len = k.shape[1]
    bq, g = plan.block_q, plan.group
    has_seg = q_seg is not None
    tile = heaviest_first(t // bq)
    per_q_tile = pl.BlockSpec((None, None), lambda i, bi, hh: (bi, tile(i)))
    q_tile = pl.BlockSpec((None, bq, None, d), lambda i, bi, hh: (bi, tile(i), hh, 0))
    # K/V head hh // g serves query head hh (GQA/MQA): shared by index, never copied.
    kv_all = pl.BlockSpec((None, s_len, None, d), lambda i, bi, hh: (bi, 0, hh // g, 0))
    q_rows = pl.BlockSpec((None, bq), lambda i, bi, hh: (bi, tile(i)))
    kv_rows = pl.BlockSpec((None, s_len), lambda i, bi, hh: (bi, 0))
    lse_tile = pl.BlockSpec((None, None, bq), lambda i, bi, hh: (bi, hh, tile(i)))
    return pl.pallas_call(
        functools.partial(_forward_kernel, plan=plan),
        grid=(t // bq, b, h),
        in_specs=[
            *[per_q_tile] * 4,
            q_tile,
            kv_all,
            kv_all,
            q_rows,
            kv_rows,
            q_rows if has_seg else None,
            kv_rows if has_seg else None,
            None if window is None else WINDOW_SPEC,
        ],
        out_specs=[q_tile, lse_tile],
        out_shape=[
            jax.ShapeDtypeStruct(q.shape, q.dtype),
            jax.ShapeDtypeStruct((b, h, t), jnp.float32),
        ],
        compiler_params=compiler_params(plan),
        interpret=plan.interpret,
        name="flash_forward",
    )(*ranges["kv"], q, k, v, q_pos, kv_pos, q_seg, kv_seg, window)
