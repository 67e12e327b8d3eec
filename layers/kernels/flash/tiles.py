"""Which keys a tile of queries may see, computed from positions and segment ids, never from a
dense [seq, kv_seq] mask.

Two levels:
- `tile_ranges` (plain XLA, before the kernels run): a conservative test per (query tile, key
  tile) pair from each tile's min/max position and segment id, reduced to the first and last
  visible tile. A kernel loops over that range only, so tiles above the causal diagonal, outside
  the sliding window or in another packed document cost no FLOPs. No assumption on positions is
  needed (a KV cache with offset query positions works); with the standard `arange` positions the
  causal range for query tile i ends exactly at the diagonal tile.
- `element_mask` (inside a kernel): the exact rule of `AttentionMask`, per element of one tile.
  Tiles inside the range that turn out fully masked are computed and masked (rare: only where
  segment or position order is unusual), which costs FLOPs but never correctness.
"""

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
    window: int | None,
    block_q: int,
    block_k: int,
) -> jax.Array:
    """[batch, q_tiles, kv_tiles] bool: False only where no element of the tile pair is visible."""
    q_min, q_max = (s[:, :, None] for s in _tile_stats(q_pos, block_q))
    k_min, k_max = (s[:, None, :] for s in _tile_stats(kv_pos, block_k))
    visible = jnp.ones(jnp.broadcast_shapes(q_min.shape, k_min.shape), bool)
    if causal:  # some key at or before some query
        visible &= k_min <= q_max
    if window is not None:  # some pair closer than the window
        visible &= q_min - k_max < window
    if q_seg is not None:  # segment ranges overlap
        qs_min, qs_max = (s[:, :, None] for s in _tile_stats(q_seg, block_q))
        ks_min, ks_max = (s[:, None, :] for s in _tile_stats(kv_seg, block_k))
        visible &= (ks_min <= qs_max) & (qs_min <= ks_max)
    return visible


def _first_last(visible: jax.Array) -> tuple[Int[Array, "..."], Int[Array, "..."]]:
    """[lo, hi) covering every True along the last axis; (0, 0) where none is True."""
    n = visible.shape[-1]
    any_visible = visible.any(axis=-1)
    lo = jnp.argmax(visible, axis=-1)
    hi = n - jnp.argmax(visible[..., ::-1], axis=-1)
    return (
        jnp.where(any_visible, lo, 0).astype(jnp.int32),
        jnp.where(any_visible, hi, 0).astype(jnp.int32),
    )


def tile_ranges(visible: jax.Array) -> dict[str, Int[Array, "batch tiles"]]:
    """Loop bounds for both directions: per query tile the key tiles [kv_lo, kv_hi), per key tile
    the query tiles [q_lo, q_hi)."""
    kv_lo, kv_hi = _first_last(visible)
    q_lo, q_hi = _first_last(jnp.swapaxes(visible, 1, 2))
    return {"kv_lo": kv_lo, "kv_hi": kv_hi, "q_lo": q_lo, "q_hi": q_hi}


def element_mask(
    q_pos: jax.Array,
    kv_pos: jax.Array,
    q_seg: jax.Array | None,
    kv_seg: jax.Array | None,
    *,
    causal: bool,
    window: int | None,
) -> jax.Array | None:
    """[block_q, block_k] bool, the rule of `AttentionMask` for one tile (None: all visible)."""
    allowed = None

    def both(a, b):
        return b if a is None else a & b

    if causal:
        allowed = both(allowed, kv_pos[None, :] <= q_pos[:, None])
    if window is not None:
        allowed = both(allowed, q_pos[:, None] - kv_pos[None, :] < window)
    if q_seg is not None:
        allowed = both(allowed, q_seg[:, None] == kv_seg[None, :])
    return allowed
