"""`flash_attention`: the kernel behind `attention="flash"`, differentiable through a
`jax.custom_vjp` whose backward runs the Pallas dK/dV and dQ kernels from the saved log-sum-exp.

Decode (one query token against a long cache, seq == 1) is routed, by design and on every
backend, to `xla_attention`: a single query row has no tile to skip or reuse, its score row
[batch, heads, 1, kv_seq] is no bigger than the K/V it reads, and the step is bound by reading
the cache once, which XLA's fused einsums already do at memory bandwidth. Triton's matmul also
needs tiles of >= 16 rows, so a one-row Pallas tile would waste 15/16 of every product.
"""

import functools
import math

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name
from jax.sharding import PartitionSpec
from jaxtyping import Array, Float

from layers.kernels.flash.backward import flash_backward
from layers.kernels.flash.config import (
    DEFAULT_BLOCK_SIZES,
    MIN_BLOCK,
    BlockSizes,
    Plan,
    check_inputs,
    fit_block,
)
from layers.kernels.flash.forward import flash_forward
from layers.kernels.flash.tiles import tile_ranges, tile_visibility
from layers.kernels.mask import AttentionMask
from layers.kernels.naive import naive_attention
from layers.kernels.xla import xla_attention
from shard.manual import active_specs, per_shard
from shard.rules import mesh_axes_of


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _attention(plan: Plan, q, k, v, layout):
    out, _ = _attention_forward(plan, q, k, v, layout)
    return out


# Names of the forward's residuals: a remat policy that saves them (zoo's "dots") keeps the
# backward from re-running the forward kernel.
RESIDUAL_NAMES = ("flash_out", "flash_lse")


def _attention_forward(plan: Plan, q, k, v, layout):
    out, lse = flash_forward(q, k, v, *layout["rows"], layout["forward"], plan)
    out, lse = (checkpoint_name(x, n) for x, n in zip((out, lse), RESIDUAL_NAMES, strict=True))
    return out, (q, k, v, out, lse, layout)


def _attention_backward(plan: Plan, residuals, d_out):
    q, k, v, out, lse, layout = residuals
    dq, dk, dv = flash_backward(q, k, v, out, lse, d_out, *layout["rows"], layout["backward"], plan)
    return dq, dk, dv, None


_attention.defvjp(_attention_forward, _attention_backward)


def _ranges(mask: AttentionMask, rows, block_q: int, block_k: int):
    # The window may be traced (a per-layer value): these bounds are plain XLA, so whole tiles
    # outside it are still skipped.
    visible, full = tile_visibility(
        *rows[:4], causal=mask.causal, window=mask.sliding_window, block_q=block_q, block_k=block_k
    )
    return tile_ranges(visible, full)


Q_AXES = "batch seq heads head_dim"
KV_AXES = "batch kv_seq kv_heads head_dim"


def _check_specs(q_spec: PartitionSpec, kv_spec: PartitionSpec) -> None:
    """Per shard, each device needs whole sequences, whole heads and whole GQA groups."""
    for spec, names in ((q_spec, Q_AXES.split()), (kv_spec, KV_AXES.split())):
        for name in ("seq", "kv_seq", "head_dim"):
            if name in names and mesh_axes_of(spec[names.index(name)]):
                raise ValueError(
                    f"flash attention runs per shard over batch and heads only, but the sharding "
                    f"rules split {name!r} over mesh axes {spec[names.index(name)]!r}; map "
                    f"{name!r} to None in the rules (sequence-parallel attention is not "
                    "implemented) or use attention='xla'"
                )
    if mesh_axes_of(q_spec[2]) != mesh_axes_of(kv_spec[2]):
        raise ValueError(
            f"flash attention: the sharding rules split 'heads' over {q_spec[2]!r} but "
            f"'kv_heads' over {kv_spec[2]!r}; map both to the same mesh axes so that each "
            "device holds whole groups of query heads with their K/V head"
        )


def flash_attention(
    q: Float[Array, "batch seq heads head_dim"],
    k: Float[Array, "batch kv_seq kv_heads head_dim"],
    v: Float[Array, "batch kv_seq kv_heads head_dim"],
    mask: AttentionMask,
    *,
    softcap: float | None = None,
    block_sizes: BlockSizes = DEFAULT_BLOCK_SIZES,
    interpret: bool | None = None,
) -> Float[Array, "batch seq heads head_dim"]:
    """softmax(softcap(q k^T / sqrt(d)) + mask) v without materialising the score matrix (Dao et
    al. 2022; FlashAttention-2, Dao 2023), same contract as `naive_attention`. The mask's sliding
    window may be a traced value (one per layer): tile skipping and the element mask both use it.

    `interpret=None` runs the Pallas interpreter when the default backend is the CPU and compiles
    through Triton otherwise. seq == 1 (decode) uses `xla_attention` (see the module docstring),
    or, with a `softcap` (which jax.nn.dot_product_attention lacks), `naive_attention`'s einsums:
    the same XLA products over one query row.
    Any sequence length: one that is not a multiple of the (clipped) tiles is padded inside
    the kernel (`padded_length`; the padded keys are invisible, the padded rows dropped).
    head_dim must be a power of two in [16, 256] and the dtype float32, bfloat16 or float16;
    anything else is a ValueError.
    A query that sees no key at all (impossible in causal self-attention) gets an arbitrary but
    finite output (naive gives the mean of V), which no test or caller should rely on.

    Under active sharding rules (`shard.use_rules`) the kernel runs per shard (`jax.shard_map`):
    XLA cannot partition a Pallas call and would all-gather q, k, v to every device. The batch is
    split as the rules split "batch", heads as they split "heads"/"kv_heads" (which must agree);
    rules that split the sequence or head_dim are a ValueError.
    """
    check_inputs(q.shape, k.shape, v.shape, q.dtype, k.dtype, v.dtype)
    if q.shape[1] == 1:
        if softcap is not None:
            return naive_attention(q, k, v, mask, softcap=softcap)
        return xla_attention(q, k, v, mask)
    specs = active_specs(Q_AXES, KV_AXES)
    if specs is not None:
        _check_specs(*specs)
    # The window (one scalar, every shard's) is closed over, not split like the mask's rows.
    window = mask.sliding_window

    def local(q, k, v, rows_mask):
        return _flash_local(
            q, k, v, rows_mask.with_window(window),
            softcap=softcap, block_sizes=block_sizes, interpret=interpret,
        )  # fmt: skip

    return per_shard(local, in_axes=(Q_AXES, KV_AXES, KV_AXES, "batch"), out_axes=Q_AXES)(
        q, k, v, mask.with_window(None)
    )


def padded_length(length: int, *blocks: int) -> int:
    """The length the kernel runs `length` at: a multiple of every tile along it (each tile
    clipped to the next power of two >= 16 of the length), so that any length runs."""
    clipped = min(max(MIN_BLOCK, 1 << (length - 1).bit_length()), max(blocks))
    tile = max(min(block, clipped) for block in blocks)
    return -(-length // tile) * tile


def _pad(q, k, v, mask: AttentionMask, q_len: int, kv_len: int):
    """q to `q_len` rows and k, v to `kv_len` with zeros, the mask extended so that no query
    sees a padded key (their segment id is one no query has) and each padded query sees what
    the last real one sees (finite values and gradients; its output is dropped)."""
    n_q, n_kv = q_len - q.shape[1], kv_len - k.shape[1]

    def zeros(x, n):
        return jnp.pad(x, ((0, 0), (0, n), (0, 0), (0, 0)))

    def edge(x, n):
        return jnp.pad(x.astype(jnp.int32), ((0, 0), (0, n)), mode="edge")

    q_seg, kv_seg = mask.q_segment_ids, mask.kv_segment_ids
    if q_seg is None:
        q_seg, kv_seg = jnp.zeros_like(mask.q_positions), jnp.zeros_like(mask.kv_positions)
    nobody = jnp.iinfo(jnp.int32).min
    kv_seg = jnp.pad(kv_seg.astype(jnp.int32), ((0, 0), (0, n_kv)), constant_values=nobody)
    padded = AttentionMask(
        edge(mask.q_positions, n_q), edge(mask.kv_positions, n_kv), edge(q_seg, n_q), kv_seg,
        mask.causal, mask.sliding_window,
    )  # fmt: skip
    return zeros(q, n_q), zeros(k, n_kv), zeros(v, n_kv), padded


def _flash_local(q, k, v, mask: AttentionMask, *, softcap, block_sizes: BlockSizes, interpret):
    """The kernel on the arrays one device holds (all of them when nothing is sharded), at
    lengths padded to its tiles."""
    seq, kv_seq = q.shape[1], k.shape[1]
    blocks = block_sizes
    q_len = padded_length(seq, blocks.block_q, blocks.backward_block_q)
    kv_len = padded_length(kv_seq, blocks.block_k, blocks.backward_block_k)
    if (q_len, kv_len) != (seq, kv_seq):
        q, k, v, mask = _pad(q, k, v, mask, q_len, kv_len)
    out = _flash_tiled(q, k, v, mask, softcap=softcap, block_sizes=blocks, interpret=interpret)
    return out[:, :seq]


def _flash_tiled(q, k, v, mask: AttentionMask, *, softcap, block_sizes: BlockSizes, interpret):
    """The kernel on lengths that are multiples of its tiles."""
    seq, kv_seq, head_dim = q.shape[1], k.shape[1], q.shape[3]
    blocks, window = block_sizes, mask.sliding_window
    plan = Plan(
        causal=mask.causal,
        windowed=mask.sliding_window is not None,
        softcap=softcap,
        scale=1.0 / math.sqrt(head_dim),
        group=q.shape[2] // k.shape[2],
        block_q=fit_block(blocks.block_q, seq, name="query", field="block_q"),
        block_k=fit_block(blocks.block_k, kv_seq, name="key/value", field="block_k"),
        backward_block_q=fit_block(
            blocks.backward_block_q, seq, name="query", field="backward_block_q"
        ),
        backward_block_k=fit_block(
            blocks.backward_block_k, kv_seq, name="key/value", field="backward_block_k"
        ),
        num_warps=blocks.num_warps,
        num_stages=blocks.num_stages,
        backward_dq=blocks.backward_dq,
        interpret=jax.default_backend() == "cpu" if interpret is None else interpret,
    )
    rows = (
        mask.q_positions.astype(jnp.int32),
        mask.kv_positions.astype(jnp.int32),
        None if mask.q_segment_ids is None else mask.q_segment_ids.astype(jnp.int32),
        None if mask.kv_segment_ids is None else mask.kv_segment_ids.astype(jnp.int32),
        None if window is None else jnp.asarray(window, jnp.int32).reshape(1),
    )
    layout = {
        "rows": rows,
        "forward": _ranges(mask, rows, plan.block_q, plan.block_k),
        "backward": _ranges(mask, rows, plan.backward_block_q, plan.backward_block_k),
    }
    return _attention(plan, q, k, v, layout)
