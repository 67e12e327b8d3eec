"""Attention over a sequence split across devices (context parallelism): the two kernels that
run when the sharding rules split `seq` over a mesh axis (`shard.rules.split_sequence`).

- `Ring()`: ring attention (Liu et al. 2023, "Ring Attention with Blockwise Transformers").
  Each device keeps its queries; K/V blocks (with their positions and segment ids) travel
  around the ring by `jax.lax.ppermute`, one hop per step, and every block is folded into an
  online softmax (running max and denominator, Milakov & Gimelshein 2018), so no device ever
  holds more than its own K/V and one visiting block. The backward (a `jax.custom_vjp`) runs
  the ring again from the saved log-sum-exp, the dK/dV accumulators travelling with their
  block and arriving home after the last hop (FlashAttention-2's backward per block).
- `AllGatherKV()`: all-gather K/V over the axis, then each device attends its own queries to
  the whole sequence with `xla_attention` (Llama 3's context parallelism); autodiff turns the
  gather into a reduce-scatter of dK/dV. One collective instead of n - 1 hops, a smaller
  backward, but every device holds the whole K/V and computes its dense score block.
  `zoo.math.context_attention_cost` prints both; `training.plan` shows which is cheaper.

Each device's slice is cut into two chunks and every (query chunk, K/V chunk) pair that the
mask leaves wholly invisible is skipped (`lax.cond`). With the zig-zag layout the model puts
the sequence in (`shard.sequence`: device i holds chunks i and 2n - 1 - i), each ring step
then does the same work on every device; correctness never depends on the layout, since the
mask is built from the positions and segment ids that travel with the blocks.
"""

import dataclasses
import functools
import math
from collections.abc import Sequence
from typing import ClassVar

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float

from layers.kernels.mask import AttentionMask
from layers.kernels.support import Supports
from layers.kernels.xla import xla_attention
from shard.manual import per_shard
from shard.sequence import sequence_axis

# Both context kernels: no soft-capping, one fixed window, a sequence cut into 2 x context chunks.
CONTEXT_SUPPORTS = Supports(
    softcap=False,
    per_layer_window=False,
    lengths="self-attention over a sequence of 2 x (the context axis) equal chunks",
)
Q_AXES = "batch seq heads head_dim"
KV_AXES = "batch seq kv_heads head_dim"


def _check(name: str, q, k, mask: AttentionMask, softcap: float | None) -> None:
    if softcap is not None:
        raise ValueError(
            f"the {name!r} context-parallel kernel does not implement logit softcapping "
            f"(softcap={softcap}); use a model without attention softcapping or an unsplit mesh"
        )
    if isinstance(mask.sliding_window, jax.Array):
        raise ValueError(
            f"the {name!r} context-parallel kernel takes a fixed sliding window, but this mask's "
            "differs per layer (Config.layer_types: Gemma 2/3); train such models on a mesh "
            "without a context axis"
        )
    if k.shape[1] != q.shape[1] or mask.kv_positions.shape[1] != mask.q_positions.shape[1]:
        raise ValueError(
            f"the {name!r} context-parallel kernel is self-attention over the split sequence, "
            f"but the queries have {q.shape[1]} tokens and the keys {k.shape[1]}: a KV cache "
            "(prefill or decode) under context parallelism is not supported"
        )


def _mask_leaves(mask: AttentionMask) -> tuple:
    return mask.kv_positions, mask.kv_segment_ids


def _block_mask(mask: AttentionMask, q_rows: slice, kv: Sequence, kv_cols: slice):
    """Visibility [batch, q chunk, kv chunk] of these query rows to this K/V chunk."""
    kv_pos, kv_seg = kv
    q_seg = None if mask.q_segment_ids is None else mask.q_segment_ids[:, q_rows]
    block = dataclasses.replace(
        mask,
        q_positions=mask.q_positions[:, q_rows],
        kv_positions=kv_pos[:, kv_cols],
        q_segment_ids=q_seg,
        kv_segment_ids=None if kv_seg is None else kv_seg[:, kv_cols],
    )
    return block.dense()


def _chunks(t: int) -> list[slice]:
    """Two chunks of a device's slice (one if it is odd): the unit of block skipping."""
    if t % 2:
        return [slice(0, t)]
    return [slice(0, t // 2), slice(t // 2, t)]


def _grouped(x, n_kv: int):
    """[batch, t, heads, d] -> [batch, t, kv_heads, group, d] in float32."""
    b, t, h, d = x.shape
    return x.reshape(b, t, n_kv, h // n_kv, d).astype(jnp.float32)


def _forward_block(state, q, k, v, allowed):
    """Fold one visible (query chunk, K/V chunk) block into the online softmax state
    (acc [b, t, kv, g, d], running max m and denominator l [b, kv, g, t])."""
    acc, m, denom = state
    scores = jnp.einsum("btkgd,bskd->bkgts", q, k) / math.sqrt(q.shape[-1])
    scores = jnp.where(allowed[:, None, None], scores, -jnp.inf)
    m_new = jnp.maximum(m, scores.max(-1))
    # A row with nothing visible yet keeps max -inf; 0 stands in so exp() gives 0, not NaN.
    m_safe = jnp.where(jnp.isfinite(m_new), m_new, 0.0)
    p = jnp.exp(scores - m_safe[..., None])
    scale = jnp.exp(m - m_safe)
    denom = denom * scale + p.sum(-1)
    acc = acc * jnp.moveaxis(scale, -1, 1)[..., None] + jnp.einsum("bkgts,bskd->btkgd", p, v)
    return acc, m_new, denom


def _backward_block(grads, q, k, v, d_out, lse, delta, allowed):
    """dQ for the query chunk and dK, dV for the K/V chunk from one visible block."""
    dq, dk, dv = grads
    scale = 1.0 / math.sqrt(q.shape[-1])
    scores = jnp.einsum("btkgd,bskd->bkgts", q, k) * scale
    p = jnp.where(allowed[:, None, None], jnp.exp(scores - lse[..., None]), 0.0)
    dv = dv + jnp.einsum("bkgts,btkgd->bskd", p, d_out)
    dp = jnp.einsum("btkgd,bskd->bkgts", d_out, v)
    ds = p * (dp - delta[..., None]) * scale
    dq = dq + jnp.einsum("bkgts,bskd->btkgd", ds, k)
    dk = dk + jnp.einsum("bkgts,btkgd->bskd", ds, q)
    return dq, dk, dv


def _skip_unless_visible(allowed, compute, state):
    return jax.lax.cond(allowed.any(), compute, lambda s: s, state)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _ring_local(axis: str | None, n: int, q, k, v, mask: AttentionMask):
    """The per-device ring (inside `shard_map`): q [b, t, heads, d], k, v [b, t, kv, d] are this
    device's slices, `mask` holds this device's positions and segment ids."""
    out, _ = _ring_forward(axis, n, q, k, v, mask)
    return out


def _hop(axis: str | None, n: int, x):
    """Pass `x` (a pytree) one device along the ring: device i sends to i + 1."""
    return jax.lax.ppermute(x, axis, [(i, (i + 1) % n) for i in range(n)])


def _ring_forward(axis, n, q, k, v, mask):
    n_kv = k.shape[2]
    qg = _grouped(q, n_kv)
    rows = _chunks(q.shape[1])
    b, _, kvh, g, d = qg.shape
    init = [
        (
            jnp.zeros((b, r.stop - r.start, kvh, g, d), jnp.float32),
            jnp.full((b, kvh, g, r.stop - r.start), -jnp.inf),
            jnp.zeros((b, kvh, g, r.stop - r.start)),
        )
        for r in rows
    ]

    def visit(states, block):
        kb, vb, *kv = block
        new = []
        for r, state in zip(rows, states, strict=True):
            for c in rows:
                allowed = _block_mask(mask, r, kv, c)
                compute = lambda s, r=r, c=c, allowed=allowed: _forward_block(  # noqa: E731
                    s,
                    qg[:, r],
                    kb[:, c].astype(jnp.float32),
                    vb[:, c].astype(jnp.float32),
                    allowed,
                )
                state = _skip_unless_visible(allowed, compute, state)
            new.append(state)
        return new

    block = (k, v, *_mask_leaves(mask))
    states = visit(init, block)

    def step(carry, _):
        states, block = carry
        block = _hop(axis, n, block)
        return (visit(states, block), block), None

    if n > 1:
        (states, _), _ = jax.lax.scan(step, (states, block), None, length=n - 1)
    outs, lses = [], []
    for acc, m, denom in states:
        # Self-attention always sees itself, so no row ends with an empty denominator.
        outs.append(acc / jnp.moveaxis(denom, -1, 1)[..., None])
        lses.append(m + jnp.log(denom))
    out = jnp.concatenate(outs, axis=1).reshape(q.shape).astype(q.dtype)
    return out, (q, k, v, mask, out, jnp.concatenate(lses, axis=-1))


def _ring_backward(axis, n, residuals, d_out):
    q, k, v, mask, out, lse = residuals
    n_kv = k.shape[2]
    qg, dog = _grouped(q, n_kv), _grouped(d_out, n_kv)
    delta = jnp.einsum("btkgd,btkgd->bkgt", dog, _grouped(out, n_kv))
    rows = _chunks(q.shape[1])

    def visit(dq, block, dkv):
        kb, vb, *kv = block
        dk, dv = dkv
        for r in rows:
            for c in rows:
                allowed = _block_mask(mask, r, kv, c)

                def compute(grads, r=r, c=c, allowed=allowed):
                    dq_r, dk_c, dv_c = _backward_block(
                        grads,
                        qg[:, r],
                        kb[:, c].astype(jnp.float32),
                        vb[:, c].astype(jnp.float32),
                        dog[:, r],
                        lse[..., r],
                        delta[..., r],
                        allowed,
                    )
                    return dq_r, dk_c, dv_c

                grads = (dq[:, r], dk[:, c], dv[:, c])
                dq_r, dk_c, dv_c = _skip_unless_visible(allowed, compute, grads)
                dq, dk, dv = dq.at[:, r].set(dq_r), dk.at[:, c].set(dk_c), dv.at[:, c].set(dv_c)
        return dq, (dk, dv)

    zeros = jnp.zeros(k.shape, jnp.float32)
    block = (k, v, *_mask_leaves(mask))
    dq, dkv = visit(jnp.zeros(qg.shape), block, (zeros, zeros))

    def step(carry, _):
        dq, block, dkv = carry
        # The dK/dV accumulators travel with the block they belong to.
        block, dkv = _hop(axis, n, (block, dkv))
        dq, dkv = visit(dq, block, dkv)
        return (dq, block, dkv), None

    if n > 1:
        (dq, _, dkv), _ = jax.lax.scan(step, (dq, block, dkv), None, length=n - 1)
        dkv = _hop(axis, n, dkv)  # after n - 1 hops the block came from device i + 1: send home
    dk, dv = dkv
    return dq.reshape(q.shape).astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype), None


_ring_local.defvjp(_ring_forward, _ring_backward)


def _allgather_local(axis: str | None, q, k, v, mask: AttentionMask):
    if axis is not None:
        k, v, kv_pos, kv_seg = jax.lax.all_gather(
            (k, v, *_mask_leaves(mask)), axis, axis=1, tiled=True
        )
        mask = dataclasses.replace(mask, kv_positions=kv_pos, kv_segment_ids=kv_seg)
    return xla_attention(q, k, v, mask)


def _run(local, name: str, q, k, v, mask: AttentionMask, softcap: float | None):
    _check(name, q, k, mask, softcap)
    axis, n = sequence_axis()
    mask_axes = "batch seq"  # every array of a self-attention mask is [batch, seq]
    f = per_shard(
        lambda q, k, v, mask: local(axis, n, q, k, v, mask),
        (Q_AXES, KV_AXES, KV_AXES, mask_axes),
        Q_AXES,
    )
    return f(q, k, v, mask)


@dataclasses.dataclass(frozen=True)
class Ring:
    """Ring attention over the mesh axis the active rules split `seq` over (on one device or
    an unsplit sequence: the same blockwise computation, no hops)."""

    name: ClassVar[str] = "ring"
    supports: ClassVar[Supports] = CONTEXT_SUPPORTS

    def __call__(
        self,
        q: Float[Array, "batch seq heads head_dim"],
        k: Float[Array, "batch kv_seq kv_heads head_dim"],
        v: Float[Array, "batch kv_seq kv_heads head_dim"],
        mask: AttentionMask,
        *,
        softcap: float | None = None,
    ) -> Float[Array, "batch seq heads head_dim"]:
        return _run(_ring_local, self.name, q, k, v, mask, softcap)


@dataclasses.dataclass(frozen=True)
class AllGatherKV:
    """All-gather K/V over the mesh axis the active rules split `seq` over, then
    `xla_attention` of the local queries against the whole sequence."""

    name: ClassVar[str] = "allgather"
    supports: ClassVar[Supports] = CONTEXT_SUPPORTS

    def __call__(
        self,
        q: Float[Array, "batch seq heads head_dim"],
        k: Float[Array, "batch kv_seq kv_heads head_dim"],
        v: Float[Array, "batch kv_seq kv_heads head_dim"],
        mask: AttentionMask,
        *,
        softcap: float | None = None,
    ) -> Float[Array, "batch seq heads head_dim"]:
        local = lambda axis, n, *args: _allgather_local(axis, *args)  # noqa: E731
        return _run(local, self.name, q, k, v, mask, softcap)


CONTEXT_KERNELS = (Ring, AllGatherKV)
