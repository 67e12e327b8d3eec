"""A sliding-window layer's cache: each row's last keys and values in a ring of `R >= window`
slots, so the layer's memory is `rows x R` whatever the context length (Mistral's rolling buffer,
Jiang et al. 2023; Gemma 2/3's local layers). The contiguous and the paged cache
(layers/kv_cache.py, layers/paged_cache.py) hold a `LayerWindow` instead of full-length arrays
for each layer whose window is shorter than the cache (`Transformer.init_cache`).

The ring is indexed by position: a token at position p of its row lives in slot p mod R, so ring
slot j of a row holding L tokens holds position L - 1 - ((L - 1 - j) mod R) when that is >= 0
(left padding and page tables play no part). A call attends over the ring as it was before the
call followed by the call's own keys and values, then keeps each row's last R tokens: a query at
position p needs the keys at (p - window, p], which the old ring and the call's tokens cover
however long the call (a prefill chunk may be longer than the window).
"""

from collections.abc import Callable

import equinox as eqx
import jax.numpy as jnp
from jax.typing import DTypeLike
from jaxtyping import Array, Bool, Float, Int

from layers.kernels.mask import AttentionMask

RING_AXES = ("batch", "kv_seq", "kv_heads", "head_dim")
# Keys + new tokens of a multi-token call are padded to a multiple of this (invisible slots),
# so the flash kernel's key tiles divide them.
KEY_TILE = 64


class LayerWindow(eqx.Module):
    """One sliding layer's rings `[*layers, rows, R, kv_heads, head_dim]` (the kernels' layout)."""

    k: Float[Array, "*layers rows ring kv_heads head_dim"]
    v: Float[Array, "*layers rows ring kv_heads head_dim"]

    @staticmethod
    def zeros(
        rows: int, ring: int, kv_heads: int, head_dim: int, dtype: DTypeLike, *, layers=()
    ) -> "LayerWindow":
        shape = (*tuple(layers), rows, ring, kv_heads, head_dim)
        return LayerWindow(k=jnp.zeros(shape, dtype), v=jnp.zeros(shape, dtype))

    @property
    def ring(self) -> int:
        return self.k.shape[-3]

    def logical_axes(self) -> dict[str, tuple[str, ...]]:
        return {"k": RING_AXES, "v": RING_AXES}


def ring_positions(lengths: Int[Array, " batch"], ring: int) -> Int[Array, "batch ring"]:
    """The position each ring slot holds for rows of `lengths` tokens (negative: empty)."""
    last = lengths[:, None] - 1
    return last - jnp.mod(last - jnp.arange(ring), ring)


class WindowSlot(eqx.Module):
    """One sliding layer's view for one call: its rings (`kv`, `layer` the index into stacked
    rings or None), `rows` the ring row of each batch row (None: batch row i is ring row i),
    `lengths` the tokens each row held before the call, and the call's positions and validity."""

    kv: LayerWindow
    layer: Int[Array, ""] | None
    rows: Int[Array, " batch"] | None
    lengths: Int[Array, " batch"]
    positions: Int[Array, "batch seq"]
    valid: Bool[Array, "batch seq"]

    def _read(self, ring: Array) -> Float[Array, "batch ring kv_heads head_dim"]:
        layer = ring if self.layer is None else ring[self.layer]
        return layer if self.rows is None else layer[self.rows]

    def _write(self, ring: Array, new: Float[Array, "batch seq kv_heads head_dim"]) -> Array:
        """Each row's last `R` new tokens into slots position mod R; the rest (padding, tokens
        a later one of the same call overwrites) are dropped."""
        size = ring.shape[-3]
        end = (self.lengths + self.valid.sum(axis=1))[:, None]
        keep = self.valid & (self.positions >= end - size)
        slot = jnp.where(keep, jnp.mod(self.positions, size), size)  # out of bounds: dropped
        rows = (jnp.arange(new.shape[0]) if self.rows is None else self.rows)[:, None]
        index = (rows, slot) if self.layer is None else (self.layer, rows, slot)
        return ring.at[index].set(new.astype(ring.dtype), mode="drop")

    def attend(
        self,
        q: Float[Array, "batch seq heads head_dim"],
        k: Float[Array, "batch seq kv_heads head_dim"],
        v: Float[Array, "batch seq kv_heads head_dim"],
        mask: AttentionMask,
        kernel: Callable,
        *,
        softcap: float | None = None,
    ) -> tuple[Float[Array, "batch seq heads head_dim"], "WindowSlot"]:
        """`kernel` over [the ring before this call, this call's k and v] (the mask's window
        applies), then the rings with this call's tokens written."""
        seq = self.valid.shape[1]
        old_positions = ring_positions(self.lengths, self.kv.ring)
        keys = jnp.concatenate([self._read(self.kv.k), k.astype(self.kv.k.dtype)], axis=1)
        values = jnp.concatenate([self._read(self.kv.v), v.astype(self.kv.v.dtype)], axis=1)
        kv_positions = jnp.concatenate([old_positions, self.positions], axis=1)
        kv_segments = jnp.concatenate([old_positions >= 0, self.valid], axis=1).astype(jnp.int32)
        pad = (-keys.shape[1]) % KEY_TILE if seq > 1 else 0
        if pad:
            widths = ((0, 0), (0, pad), (0, 0), (0, 0))
            keys, values = jnp.pad(keys, widths), jnp.pad(values, widths)
            kv_positions = jnp.pad(kv_positions, ((0, 0), (0, pad)))
            kv_segments = jnp.pad(kv_segments, ((0, 0), (0, pad)))
        window_mask = AttentionMask(
            q_positions=self.positions,
            kv_positions=kv_positions,
            q_segment_ids=self.valid.astype(jnp.int32),
            kv_segment_ids=kv_segments,
            causal=True,
            sliding_window=mask.sliding_window,
        )
        out = kernel(q, keys, values, window_mask, softcap=softcap)
        rings = LayerWindow(self._write(self.kv.k, k), self._write(self.kv.v, v))
        return out, eqx.tree_at(lambda s: s.kv, self, rings)
