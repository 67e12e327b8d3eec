"""Which keys a tile of queries may see, computed from positions and segment ids, never from a
dense [seq, kv_seq] mask.

Two levels:
- `tile_ranges` (plain XLA, before the kernels run): conservative tests per (query tile, key
  tile) pair from each tile's min/max position and segment id, reduced to loop bounds
  lo <= full_lo <= full_hi <= hi. A kernel visits tiles [lo, hi) only, so tiles above the causal
  diagonal, outside the sliding window or in another packed document cost no FLOPs; inside
  [full_lo, full_hi) every element is visible and the per-element mask is skipped too (with
  causal `arange` positions only the diagonal tiles are masked). No assumption on positions is
  needed (a KV cache with offset query positions works); with the standard `arange` positions the
  causal range of query tile i ends exactly at its diagonal tile.
- `element_mask` (inside a kernel): the exact rule of `AttentionMask`, per element of one tile.
  Tiles inside [lo, hi) that turn out fully masked are computed and masked (rare: only where
  segment or position order is unusual), which costs FLOPs but never correctness.
"""

import functools

import jax
import jax.numpy as jnp
from jaxtyping import Array, Int


def _tile_stats(x: Int[Array, "batch n"], block: int) -> tuple[Array, Array]:
    tiles = x.reshape(x.shape[0], -1, block)
    return tiles.min(axis=-1), tiles.max(axis=-1)


def tile_visibility(
    q_pos: Int[Array, "batch seq"],
    kv_pos: Int[Array, "batch kv_seq"],
    q_seg: Int[Array, "batch seq"] | None,
    kv_seg: Int[Array, "batch kv_seq"] | None,
    *,
    causal: bool,
    window: jax.Array | int | None,
    block_q: int,
    block_k: int,
) -> tuple[jax.Array, jax.Array]:
    """Two [batch, q_tiles, kv_tiles] bools: `visible` is False only where no element of the tile
    pair is visible; `full` is True only where every element is."""
    q_min, q_max = (s[:, :, None] for s in _tile_stats(q_pos, block_q))
    k_min, k_max = (s[:, None, :] for s in _tile_stats(kv_pos, block_k))
    visible = jnp.ones(jnp.broadcast_shapes(q_min.shape, k_min.shape), bool)
    full = visible
    if causal:  # some key at or before some query / every key before every query
        visible &= k_min <= q_max
        full &= k_max <= q_min
    if window is not None:  # some pair / every pair closer than the window
        visible &= q_min - k_max < window
        full &= q_max - k_min < window
    if q_seg is not None:  # segment ranges overlap / one segment for the whole tile pair
        qs_min, qs_max = (s[:, :, None] for s in _tile_stats(q_seg, block_q))
        ks_min, ks_max = (s[:, None, :] for s in _tile_stats(kv_seg, block_k))
        visible &= (ks_min <= qs_max) & (qs_min <= ks_max)
        full &= (qs_min == qs_max) & (ks_min == ks_max) & (qs_min == ks_min)
    return visible, full & visible


def _bounds(visible: jax.Array, full: jax.Array) -> tuple[jax.Array, ...]:
    """lo <= full_lo <= full_hi <= hi along the last axis: [lo, hi) covers every visible tile,
    [full_lo, full_hi) is the first run of fully visible tiles (empty, at lo, if none)."""
    n = visible.shape[-1]
    index = jnp.arange(n)
    any_visible, any_full = visible.any(axis=-1), full.any(axis=-1)
    lo = jnp.where(any_visible, jnp.argmax(visible, axis=-1), 0)
    hi = jnp.where(any_visible, n - jnp.argmax(visible[..., ::-1], axis=-1), 0)
    full_lo = jnp.where(any_full, jnp.argmax(full, axis=-1), lo)
    after_run = (index >= full_lo[..., None]) & ~full
    full_hi = jnp.where(any_full, jnp.min(jnp.where(after_run, index, n), axis=-1), lo)
    return tuple(x.astype(jnp.int32) for x in (lo, full_lo, full_hi, hi))


def tile_ranges(visible: jax.Array, full: jax.Array) -> dict[str, tuple[jax.Array, ...]]:
    """Loop bounds for both directions, each `(lo, full_lo, full_hi, hi)` of [batch, tiles]:
    per query tile over key tiles ("kv") and per key tile over query tiles ("q")."""
    return {
        "kv": _bounds(visible, full),
        "q": _bounds(jnp.swapaxes(visible, 1, 2), jnp.swapaxes(full, 1, 2)),
    }


def walk_tiles(bounds_refs, step, carry):
    """Inside a kernel: run `step(j, carry, masked)` over tiles [lo, hi), with the element mask
    only outside the fully visible run [full_lo, full_hi)."""
    lo, full_lo, full_hi, hi = (ref[...] for ref in bounds_refs)
    carry = jax.lax.fori_loop(lo, full_lo, functools.partial(step, masked=True), carry)
    carry = jax.lax.fori_loop(full_lo, full_hi, functools.partial(step, masked=False), carry)
    return jax.lax.fori_loop(full_hi, hi, functools.partial(step, masked=True), carry)


def element_mask(
    q_pos: jax.Array,
    kv_pos: jax.Array,
    q_seg: jax.Array | None,
    kv_seg: jax.Array | None,
    *,
    causal: bool,
    window: jax.Array | int | None,
    transposed: bool = False,
) -> jax.Array | None:
    """[block_q, block_k] bool, the rule of `AttentionMask` for one tile, or [block_k, block_q]
    when `transposed` (for a kernel that computes S^T = K Q^T); None: all visible."""

    def pair(q, kv):
        return (q[None, :], kv[:, None]) if transposed else (q[:, None], kv[None, :])

    allowed = None

    def both(a, b):
        return b if a is None else a & b

    q_pos, kv_pos = pair(q_pos, kv_pos)
    if causal:
        allowed = both(allowed, kv_pos <= q_pos)
    if window is not None:
        allowed = both(allowed, q_pos - kv_pos < window)
    if q_seg is not None:
        q_seg, kv_seg = pair(q_seg, kv_seg)
        allowed = both(allowed, q_seg == kv_seg)
    return allowed
