"""The paged KV cache: every layer's keys and values in a pool of fixed-size pages shared by all
rows, and a page table per row (vLLM's PagedAttention, Kwon et al. 2023), so memory follows the
tokens actually held rather than `batch x max_len`. The pool layout is
layers/kernels/paged/pages.py's: `[kv_heads, pages, page_size, head_dim]` per layer (with leading
stacked dims when the model's layers are stacked).

MLA layers (layers/mla.py) keep one pool, `LatentPages`: the latents `[1, pages, page_size,
latent]` in the same layout with a single K/V head, passed to the kernels as keys and values.

The model's forward takes it like the contiguous cache (layers/kv_cache.py's protocol): `append`
numbers the new tokens from each row's length; each layer's `PagedSlot` scatters the new keys and
values into the row's pages, then attends. A decode step (one query per row) runs the
`decode_kernel` over the pages when one is given (the Pallas kernel on GPU); otherwise, and for
prefill chunks, the row's pages are gathered into a contiguous view and the model's own kernel
(naive, xla or flash) runs on it, so every kernel serves every prompt length.

The page table and the lengths are host-managed (infer/engine.py allocates and frees pages): they
are arguments of each call, so new tables never recompile anything.
"""

import equinox as eqx
import jax
import jax.numpy as jnp
from jax.typing import DTypeLike
from jaxtyping import Array, Bool, Float, Int, PyTree

from layers.kernels import AttentionMask
from layers.kernels.paged import PallasDecodeKernel, paged_attention
from layers.kv_cache import Appended
from layers.window_cache import LayerWindow, WindowSlot

POOL_AXES = ("kv_heads", "pages", "page_size", "head_dim")


class LayerPages(eqx.Module):
    """One layer's key and value pools (leading `layers` dims when stacked)."""

    k: Float[Array, "*layers kv_heads pages page_size head_dim"]
    v: Float[Array, "*layers kv_heads pages page_size head_dim"]

    @staticmethod
    def zeros(
        n_pages: int, page_size: int, kv_heads: int, head_dim: int, dtype: DTypeLike, *, layers=()
    ) -> "LayerPages":
        shape = (*tuple(layers), kv_heads, n_pages, page_size, head_dim)
        return LayerPages(k=jnp.zeros(shape, dtype), v=jnp.zeros(shape, dtype))

    def logical_axes(self) -> dict[str, tuple[str, ...]]:
        return {"k": POOL_AXES, "v": POOL_AXES}


class LatentPages(eqx.Module):
    """One MLA layer's pool of latents `[c, k_pe]` (leading `layers` dims when stacked)."""

    c: Float[Array, "*layers one pages page_size latent"]

    @staticmethod
    def zeros(
        n_pages: int, page_size: int, width: int, dtype: DTypeLike, *, layers=()
    ) -> "LatentPages":
        return LatentPages(c=jnp.zeros((*tuple(layers), 1, n_pages, page_size, width), dtype))

    def logical_axes(self) -> dict[str, tuple[str, ...]]:
        return {"c": ("latent_heads", "pages", "page_size", "latent")}


class PagedSlot(eqx.Module):
    """One layer's view for one call: its pools (`pages`, with `layer` its index when stacked),
    the rows' page tables and lengths (after this call's tokens), and the new tokens' positions
    and validity."""

    pages: LayerPages | LatentPages
    layer: Int[Array, ""] | None
    page_table: Int[Array, "batch row_pages"]
    lengths: Int[Array, " batch"]
    positions: Int[Array, "batch seq"]
    valid: Bool[Array, "batch seq"]
    decode_kernel: PallasDecodeKernel | None = eqx.field(static=True)

    @property
    def kv(self) -> LayerPages | LatentPages:
        return self.pages

    def _write(self, pool, new):
        """Scatter `new` [batch, seq, kv_heads, head_dim] into `pool` at the tokens' pages and
        offsets; padding and positions past a row's table write nothing (mode="drop")."""
        page_size, n_pages = pool.shape[-2], pool.shape[-3]
        row_pages = self.page_table.shape[1]
        slot = self.positions // page_size
        keep = self.valid & (self.positions >= 0) & (slot < row_pages)
        page = jnp.take_along_axis(self.page_table, jnp.clip(slot, 0, row_pages - 1), axis=1)
        page = jnp.where(keep, page, n_pages)  # out of bounds: dropped
        offset = self.positions % page_size
        new = new.astype(pool.dtype)
        if self.layer is None:  # pool[:, page, offset] is [kv_heads, batch, seq, head_dim]
            return pool.at[:, page, offset].set(jnp.transpose(new, (2, 0, 1, 3)), mode="drop")
        # With the layer index apart from page/offset, NumPy indexing puts [batch, seq] first.
        return pool.at[self.layer, :, page, offset].set(new, mode="drop")

    def _contiguous(self, pool) -> Float[Array, "batch kv_seq kv_heads head_dim"]:
        """The rows' pages as one `[batch, row_pages * page_size, kv_heads, head_dim]` view."""
        if self.layer is None:
            pages = pool[:, self.page_table]  # [kv_heads, batch, row_pages, page_size, d]
            pages = jnp.moveaxis(pages, 0, 3)
        else:
            pages = pool[self.layer, :, self.page_table]  # [batch, row_pages, kv, page_size, d]
            pages = jnp.swapaxes(pages, 2, 3)
        b, p, page_size, kv, d = pages.shape
        return pages.reshape(b, p * page_size, kv, d)

    def attend(
        self,
        q: Float[Array, "batch seq heads head_dim"],
        k: Float[Array, "batch seq kv_heads head_dim"],
        v: Float[Array, "batch seq kv_heads head_dim"],
        mask: AttentionMask,
        kernel,
        *,
        softcap: float | None = None,
    ) -> tuple[Float[Array, "batch seq heads head_dim"], "PagedSlot"]:
        """Write k, v into the pages, then attend (`_attend_pools`)."""
        pages = LayerPages(self._write(self.pages.k, k), self._write(self.pages.v, v))
        view = eqx.tree_at(lambda s: s.pages, self, pages)
        return self._attend_pools(q, pages.k, pages.v, mask, kernel, softcap), view

    def attend_latent(
        self,
        q: Float[Array, "batch seq heads latent"],
        latent: Float[Array, "batch seq latent"],
        mask: AttentionMask,
        kernel,
    ) -> tuple[Float[Array, "batch seq heads latent"], "PagedSlot"]:
        """MLA: write the latents into the rows' pages, then attend with the latent pool as the
        keys and values of one K/V head (layers/mla.py)."""
        if not isinstance(self.pages, LatentPages):
            raise ValueError(
                "an MLA layer got per-head K/V pools; build the pools with the model's own "
                "init_pages so that MLA layers get latent pools"
            )
        pool = self._write(self.pages.c, latent[:, :, None, :])
        view = eqx.tree_at(lambda s: s.pages, self, LatentPages(pool))
        return self._attend_pools(q, pool, pool, mask, kernel), view

    def _attend_pools(self, q, k_pool, v_pool, mask: AttentionMask, kernel, softcap=None):
        """The paged decode kernel over the pools for one query per row, else `kernel` over the
        rows' gathered pages. The window is the mask's (this layer's, possibly traced)."""
        if self.decode_kernel is not None and q.shape[1] == 1:
            if self.layer is not None:
                raise ValueError(
                    "the paged decode kernel reads one layer's pool: use a model with unrolled "
                    "layers (model.unstacked()), or no decode kernel (the gather path)"
                )
            return paged_attention(
                q, k_pool, v_pool, self.page_table, self.lengths,
                q_positions=self.positions, sliding_window=mask.sliding_window,
                softcap=softcap, kernel=self.decode_kernel,
            )  # fmt: skip
        k_all, v_all = self._contiguous(k_pool), self._contiguous(v_pool)
        return kernel(q, k_all, v_all, mask, softcap=softcap)


def pools_and_rings(
    layers: PyTree[LayerPages | LatentPages | LayerWindow],
) -> tuple[list[LayerPages | LatentPages], list[LayerWindow]]:
    """A paged cache's per-layer entries, split into page pools and sliding layers' rings."""
    is_layer = lambda x: isinstance(x, (LayerPages, LatentPages, LayerWindow))  # noqa: E731
    pools, rings = [], []
    for layer in jax.tree.leaves(layers, is_leaf=is_layer):
        (rings if isinstance(layer, LayerWindow) else pools).append(layer)
    return pools, rings


class PagedKVCache(eqx.Module):
    """`layers`: every layer's `LayerPages` (shaped like the model's layer storage:
    `Transformer.cache_layers`), or a `LayerWindow` of per-row rings for a sliding layer whose
    window is shorter than a row's span; `page_table` `[batch, row_pages]` and `lengths`
    `[batch]` say where each row's tokens are and how many it holds; `rows` `[batch]` which
    ring row each batch row owns (None: row i owns ring row i)."""

    layers: PyTree[LayerPages | LatentPages | LayerWindow]
    page_table: Int[Array, "batch row_pages"]
    lengths: Int[Array, " batch"]
    decode_kernel: PallasDecodeKernel | None = eqx.field(static=True, default=None)
    rows: Int[Array, " batch"] | None = None

    def logical_axes(self) -> dict[str, tuple[str, ...]]:
        return {"page_table": ("batch", "pages"), "lengths": ("batch",)}

    @property
    def page_size(self) -> int:
        """Tokens per page (1 when every layer keeps a ring: no layer reads the pages)."""
        pools, _ = pools_and_rings(self.layers)
        return jax.tree.leaves(pools[0])[0].shape[-2] if pools else 1

    def with_layers(self, layers: PyTree[LayerPages | LatentPages | LayerWindow]) -> "PagedKVCache":
        return PagedKVCache(layers, self.page_table, self.lengths, self.decode_kernel, self.rows)

    def append(
        self, valid: Int[Array, "batch seq"], *, sliding_window: Int[Array, ""] | int | None = None
    ) -> Appended:
        """`seq` new tokens per row (`valid` marks real ones), at each row's next positions;
        the mask lets each attend causally to its row's tokens (slot j of a row's contiguous
        view holds position j)."""
        valid = valid.astype(jnp.int32)
        positions = jnp.where(valid > 0, self.lengths[:, None] + jnp.cumsum(valid, 1) - 1, 0)
        lengths = self.lengths + valid.sum(axis=1)
        cache = PagedKVCache(self.layers, self.page_table, lengths, self.decode_kernel, self.rows)
        kv_seq = self.page_table.shape[1] * self.page_size
        kv_positions = jnp.broadcast_to(jnp.arange(kv_seq), (valid.shape[0], kv_seq))
        mask = AttentionMask(
            q_positions=positions,
            kv_positions=kv_positions,
            q_segment_ids=valid,
            kv_segment_ids=(kv_positions < lengths[:, None]).astype(jnp.int32),
            causal=True,
            sliding_window=sliding_window,
        )

        def view(pages: LayerPages | LatentPages | LayerWindow, layer) -> PagedSlot | WindowSlot:
            if isinstance(pages, LayerWindow):
                return WindowSlot(pages, layer, self.rows, self.lengths, positions, valid > 0)
            return PagedSlot(
                pages, layer, self.page_table, lengths, positions, valid > 0, self.decode_kernel
            )  # fmt: skip

        return Appended(cache, positions, mask, view)
