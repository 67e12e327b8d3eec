"""The KV cache: its layout and logical axes, written once here and read by the model (which
writes into it), infer/ (which carries it between steps) and shard/ (which places it).

Rows fill their slots in lockstep (one shared write slot): a batch of ragged prompts is
left-padded, and each slot records its row's position and a segment id (1 = a real token, 0 =
empty or padding, which no query sees).

Layout per layer: keys `[batch, kv_heads, kv_seq, head_dim]`, values `[batch, kv_heads, head_dim,
kv_seq]`. Both put the dimension that decode attention contracts last (q.k sums over head_dim,
p.v over kv_seq), so each product is a row-major matrix-vector product per (row, K/V head) and a
GQA group of query heads shares one read of its K/V head (bench/decode_layout.py measures the
alternatives). The kernels see `[batch, kv_seq, kv_heads, head_dim]` views: transposes that XLA
folds into the products' operand layouts.

Multi-head latent attention layers (layers/mla.py) cache one array instead: `LayerLatent`, the
latent `[batch, kv_seq, latent]` (kv_rank + rope_dim numbers per token), read as the keys and
the values of one K/V head (`KVSlot.attend_latent`).

A sliding layer whose window is shorter than the cache holds a `LayerWindow` instead: a ring of
its last keys and values per row (layers/window_cache.py), which `append`'s view attends through.

A layer's arrays may carry leading stacked dims (`[layers, ...]`), mirroring weights stacked for
`lax.scan`; `KVSlot` then names which layer a block writes.

The forward pass sees a cache through one protocol, which the paged cache (layers/paged_cache.py)
shares: `append(valid, sliding_window=) -> Appended` (the bookkeeping, positions, mask and a
per-layer `view`), the view's `attend(q, k, v, mask, kernel, *, softcap) -> (out, view)`,
`with_layers`.
"""

from collections.abc import Callable
from typing import Any, NamedTuple

import equinox as eqx
import jax
import jax.numpy as jnp
from jax.typing import DTypeLike
from jaxtyping import Array, Float, Int, PyTree

from layers.kernels.mask import AttentionMask
from layers.window_cache import LayerWindow, WindowSlot

K_AXES = ("batch", "kv_heads", "kv_seq", "head_dim")
V_AXES = ("batch", "kv_heads", "head_dim", "kv_seq")


class LayerKV(eqx.Module):
    """One layer's keys and values (leading `layers` dims when stacked)."""

    k: Float[Array, "*layers batch kv_heads kv_seq head_dim"]
    v: Float[Array, "*layers batch kv_heads head_dim kv_seq"]

    @staticmethod
    def zeros(
        batch: int, kv_heads: int, max_len: int, head_dim: int, dtype: DTypeLike, *, layers=()
    ) -> "LayerKV":
        layers = tuple(layers)
        return LayerKV(
            k=jnp.zeros((*layers, batch, kv_heads, max_len, head_dim), dtype),
            v=jnp.zeros((*layers, batch, kv_heads, head_dim, max_len), dtype),
        )

    def logical_axes(self) -> dict[str, tuple[str, ...]]:
        return {"k": K_AXES, "v": V_AXES}


class LayerLatent(eqx.Module):
    """One MLA layer's cached latents `[c, k_pe]` (leading `layers` dims when stacked)."""

    c: Float[Array, "*layers batch kv_seq latent"]

    @staticmethod
    def zeros(
        batch: int, max_len: int, width: int, dtype: DTypeLike, *, layers=()
    ) -> "LayerLatent":
        return LayerLatent(c=jnp.zeros((*tuple(layers), batch, max_len, width), dtype))

    def logical_axes(self) -> dict[str, tuple[str, ...]]:
        return {"c": ("batch", "kv_seq", "latent")}


class KVSlot(eqx.Module):
    """What one block gets: its layer's arrays (`kv`, with `layer` its index into stacked
    arrays, or None for one layer's own arrays) and the slot where this step's tokens go.
    Writing touches only the new slots, so a donated cache is updated in place."""

    kv: LayerKV | LayerLatent
    layer: Int[Array, ""] | None
    slot: Int[Array, ""]

    def attend(
        self,
        q: Float[Array, "batch seq heads head_dim"],
        k: Float[Array, "batch seq kv_heads head_dim"],
        v: Float[Array, "batch seq kv_heads head_dim"],
        mask: AttentionMask,
        kernel: Callable,
        *,
        softcap: float | None = None,
    ) -> tuple[Float[Array, "batch seq heads head_dim"], "KVSlot"]:
        """Store this step's k, v at `slot`, then `kernel` over every slot of the layer (in the
        kernels' `[batch, kv_seq, kv_heads, head_dim]` view)."""
        k = k.transpose(0, 2, 1, 3).astype(self.kv.k.dtype)
        v = v.transpose(0, 2, 3, 1).astype(self.kv.v.dtype)
        if self.layer is None:
            new_k = jax.lax.dynamic_update_slice(self.kv.k, k, (0, 0, self.slot, 0))
            new_v = jax.lax.dynamic_update_slice(self.kv.v, v, (0, 0, 0, self.slot))
            layer_k, layer_v = new_k, new_v
        else:
            i = self.layer
            new_k = jax.lax.dynamic_update_slice(self.kv.k, k[None], (i, 0, 0, self.slot, 0))
            new_v = jax.lax.dynamic_update_slice(self.kv.v, v[None], (i, 0, 0, 0, self.slot))
            layer_k = jax.lax.dynamic_index_in_dim(new_k, i, keepdims=False)
            layer_v = jax.lax.dynamic_index_in_dim(new_v, i, keepdims=False)
        out = kernel(
            q, layer_k.transpose(0, 2, 1, 3), layer_v.transpose(0, 3, 1, 2), mask, softcap=softcap
        )
        return out, KVSlot(LayerKV(new_k, new_v), self.layer, self.slot)

    def attend_latent(
        self,
        q: Float[Array, "batch seq heads latent"],
        latent: Float[Array, "batch seq latent"],
        mask: AttentionMask,
        kernel: Callable,
    ) -> tuple[Float[Array, "batch seq heads latent"], "KVSlot"]:
        """MLA: store this step's latents at `slot`, then `kernel` with every slot's latent as
        the key and the value of one K/V head (layers/mla.py says why values = keys)."""
        if not isinstance(self.kv, LayerLatent):
            raise ValueError(
                "an MLA layer got a per-head KV cache; build the cache with the model's own "
                "init_cache so that MLA layers get latent arrays"
            )
        latent = latent.astype(self.kv.c.dtype)
        if self.layer is None:
            new = jax.lax.dynamic_update_slice(self.kv.c, latent, (0, self.slot, 0))
            layer_c = new
        else:
            i = self.layer
            new = jax.lax.dynamic_update_slice(self.kv.c, latent[None], (i, 0, self.slot, 0))
            layer_c = jax.lax.dynamic_index_in_dim(new, i, keepdims=False)
        kv = layer_c[:, :, None, :]
        return kernel(q, kv, kv, mask), KVSlot(LayerLatent(new), self.layer, self.slot)


class Appended(NamedTuple):
    """What `append` gives the forward pass: the cache with its bookkeeping advanced (layers
    not yet written), the new tokens' positions, the attention mask from them to every slot,
    and `view(layer_arrays, layer_index)`, the object each block writes and attends through."""

    cache: Any
    positions: Int[Array, "batch seq"]
    mask: AttentionMask
    view: Callable


class KVCache(eqx.Module):
    """Every layer's `LayerKV` (`layers`, a pytree shaped like the model's layer storage; a
    `LayerWindow` ring for a sliding layer whose window is shorter than the cache) and
    what each slot holds: `positions`/`segment_ids` `[batch, kv_seq]` for the attention mask,
    `lengths` `[batch]` the tokens each row holds (its next position), `slot` the next slot
    every row writes to."""

    layers: PyTree[LayerKV | LayerLatent | LayerWindow]
    positions: Int[Array, "batch kv_seq"]
    segment_ids: Int[Array, "batch kv_seq"]
    lengths: Int[Array, " batch"]
    slot: Int[Array, ""]

    @property
    def max_len(self) -> int:
        return self.positions.shape[1]

    @property
    def batch(self) -> int:
        return self.positions.shape[0]

    def logical_axes(self) -> dict[str, tuple[str, ...]]:
        return {
            "positions": ("batch", "kv_seq"),
            "segment_ids": ("batch", "kv_seq"),
            "lengths": ("batch",),
            "slot": (),
        }

    @staticmethod
    def empty(
        layers: PyTree[LayerKV | LayerLatent | LayerWindow], batch: int, max_len: int
    ) -> "KVCache":
        return KVCache(
            layers=layers,
            positions=jnp.zeros((batch, max_len), jnp.int32),
            segment_ids=jnp.zeros((batch, max_len), jnp.int32),
            lengths=jnp.zeros((batch,), jnp.int32),
            slot=jnp.zeros((), jnp.int32),
        )

    def with_layers(self, layers: PyTree[LayerKV | LayerLatent | LayerWindow]) -> "KVCache":
        return KVCache(layers, self.positions, self.segment_ids, self.lengths, self.slot)

    def append(
        self, valid: Int[Array, "batch seq"], *, sliding_window: Int[Array, ""] | int | None = None
    ) -> Appended:
        """Claim slots `[slot, slot + seq)` for `seq` new tokens per row, `valid` marking real
        ones (0 = padding): each real token continues its row from the row's own length, and
        attends causally to everything its row holds."""
        valid = valid.astype(jnp.int32)
        positions = jnp.where(valid > 0, self.lengths[:, None] + jnp.cumsum(valid, 1) - 1, 0)
        start = self.slot
        cache = KVCache(
            layers=self.layers,
            positions=jax.lax.dynamic_update_slice(self.positions, positions, (0, start)),
            segment_ids=jax.lax.dynamic_update_slice(self.segment_ids, valid, (0, start)),
            lengths=self.lengths + valid.sum(axis=1),
            slot=start + valid.shape[1],
        )
        # Empty and padding slots (segment 0) are seen by no real query (segment 1).
        mask = AttentionMask(
            q_positions=positions,
            kv_positions=cache.positions,
            q_segment_ids=valid,
            kv_segment_ids=cache.segment_ids,
            causal=True,
            sliding_window=sliding_window,
        )
        lengths = self.lengths

        def view(kv: LayerKV | LayerLatent | LayerWindow, layer) -> KVSlot | WindowSlot:
            if isinstance(kv, LayerWindow):
                return WindowSlot(kv, layer, None, lengths, positions, valid > 0)
            return KVSlot(kv, layer, start)

        return Appended(cache, positions, mask, view)
