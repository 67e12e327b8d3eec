"""The paged KV cache, the one cache family (layers/kv_cache.py's contract): every layer's keys and
values in a pool of fixed-size pages shared by all rows, and a page table per row (vLLM's
PagedAttention, Kwon et al. 2023), so memory follows the tokens actually held rather than
`batch x max_len`. The pool layout is layers/kernels/paged/pages.py's: `[kv_heads, pages,
page_size, head_dim]` per layer (with leading stacked dims when the model's layers are stacked).

`kv_dtype="int8"` stores the pools as int8 numbers with a bfloat16 scale per token and K/V head
(layers/kernels/paged/int8.py: about half the bytes of bfloat16 pages, a quarter of float32
ones); new tokens are quantized as they are written and the kernels read the numbers directly.
A sliding layer's ring (below) stays in the compute dtype: it holds one window per row.

MLA layers (layers/mla.py) keep one pool, `LatentPages`: the latents `[1, pages, page_size,
latent]` in the same layout with a single K/V head, read as both keys and values. A sliding layer
whose window is shorter than a row's span keeps a `LayerWindow`, a ring of its window per row
(layers/window_cache.py), instead of pages.

A call's tokens form groups (layers/token_groups.py), each continuing one row of the page table:
`model.init_cache(batch, max_len)` gives one group per batch row (prefill and decode as in any
framework), the serving engine one group per decoding request and one per prompt chunk in the
same call. Each layer's `PagedSlot` scatters the new keys and values into the rows' pages, then
attends with `paged_attention` over the blocks of pages that hold visible keys: the decode
kernel (`XlaPagedKernel()`, the Pallas `PallasDecodeKernel()` on a GPU or the C++
`CpuDecodeKernel()` on a CPU) for groups of one token, the XLA path for longer groups. Nothing
reads a row's pages past its length, so a step costs the tokens the rows hold, not `max_len`.

The page table and the lengths are host-managed (infer/engine.py allocates and frees pages): they
are arguments of each call, so new tables never recompile anything.
"""

import equinox as eqx
import jax
import jax.numpy as jnp
from jax.typing import DTypeLike
from jaxtyping import Array, Bool, Float, Int, PyTree

from layers.kernels.mask import causal_mask
from layers.kernels.paged import (
    Int8Pages,
    PagedKernel,
    Pool,
    XlaPagedKernel,
    paged_attention,
    write_pages,
)
from layers.kv_cache import Appended
from layers.token_groups import Segments, TokenGroups, check_segments
from layers.window_cache import LayerWindow, WindowSlot

POOL_AXES = ("kv_heads", "pages", "page_size", "head_dim")
LATENT_AXES = ("latent_heads", "pages", "page_size", "latent")
KV_DTYPES = ("float32", "bfloat16", "float16", "int8")


def check_kv_dtype(kv_dtype: DTypeLike | None) -> str | None:
    """The pools' dtype by name (None: the model's compute dtype), or a ValueError listing the
    choices."""
    if kv_dtype is None:
        return None
    try:
        name = jnp.dtype(kv_dtype).name
    except TypeError:
        name = None
    if name not in KV_DTYPES:
        raise ValueError(
            f"kv_dtype={kv_dtype!r} is not a KV cache dtype; choose one of {KV_DTYPES} (int8: "
            "numbers with a scale per token and K/V head) or None (the compute dtype)"
        )
    return name


def _pool(shape: tuple[int, ...], dtype: DTypeLike, axes: tuple[str, ...]) -> Pool:
    if jnp.dtype(dtype) == jnp.int8:
        return Int8Pages.zeros(shape, axes)
    return jnp.zeros(shape, dtype)


class LayerPages(eqx.Module):
    """One layer's key and value pools (leading `layers` dims when stacked), float or int8."""

    k: Pool
    v: Pool

    @staticmethod
    def zeros(
        n_pages: int, page_size: int, kv_heads: int, head_dim: int, dtype: DTypeLike, *, layers=()
    ) -> "LayerPages":
        shape = (*tuple(layers), kv_heads, n_pages, page_size, head_dim)
        return LayerPages(k=_pool(shape, dtype, POOL_AXES), v=_pool(shape, dtype, POOL_AXES))

    def logical_axes(self) -> dict[str, tuple[str, ...]]:
        return {"k": POOL_AXES, "v": POOL_AXES}


class LatentPages(eqx.Module):
    """One MLA layer's pool of latents `[c, k_pe]` (leading `layers` dims when stacked), float
    or int8 (one scale per token over the whole latent)."""

    c: Float[Array, "*layers one pages page_size latent"] | Int8Pages

    @staticmethod
    def zeros(
        n_pages: int, page_size: int, width: int, dtype: DTypeLike, *, layers=()
    ) -> "LatentPages":
        shape = (*tuple(layers), 1, n_pages, page_size, width)
        return LatentPages(c=_pool(shape, dtype, LATENT_AXES))

    def logical_axes(self) -> dict[str, tuple[str, ...]]:
        return {"c": LATENT_AXES}


def _prefill_kernel(kernel: PagedKernel | None) -> XlaPagedKernel:
    """Groups of several tokens always take the XLA path (the other kernels decode only)."""
    return kernel if isinstance(kernel, XlaPagedKernel) else XlaPagedKernel()


class PagedSlot(eqx.Module):
    """One layer's view for one call: its pools (`pages`, with `layer` its index when stacked),
    the page table, the call's token groups and the paged kernel for one-token groups."""

    pages: LayerPages | LatentPages
    layer: Int[Array, ""] | None
    page_table: Int[Array, "groups row_pages"]
    call: TokenGroups
    kernel: PagedKernel | None = eqx.field(static=True)

    @property
    def arrays(self) -> LayerPages | LatentPages:
        return self.pages

    def _write(self, pool, new: Float[Array, "batch seq kv_heads head_dim"]):
        flat = new.reshape(-1, *new.shape[2:])
        call = self.call
        return write_pages(
            pool, self.page_table, call.group, call.positions, flat, call.valid, layer=self.layer
        )

    def _attend(self, q, k_pool, v_pool, window, softcap):
        """Each run of groups against the pools (already written); `[batch, seq, heads, d]`."""
        flat = q.reshape(-1, *q.shape[2:])
        outs = []
        for start, first, n, s in self.call.runs():
            out = paged_attention(
                flat[start : start + n * s].reshape(n, s, *flat.shape[1:]),
                k_pool,
                v_pool,
                self.page_table[first : first + n],
                self.call.after[first : first + n],
                q_positions=self.call.positions[start : start + n * s].reshape(n, s),
                sliding_window=window,
                softcap=softcap,
                kernel=self.kernel if s == 1 else _prefill_kernel(self.kernel),
                layer=self.layer,
            )
            outs.append(out.reshape(n * s, *out.shape[2:]))
        out = outs[0] if len(outs) == 1 else jnp.concatenate(outs)
        return out.reshape(*q.shape[:2], *out.shape[1:])

    def attend(
        self,
        q: Float[Array, "batch seq heads head_dim"],
        k: Float[Array, "batch seq kv_heads head_dim"],
        v: Float[Array, "batch seq kv_heads head_dim"],
        *,
        window: Int[Array, ""] | int | None,
        softcap: float | None = None,
    ) -> tuple[Float[Array, "batch seq heads head_dim"], "PagedSlot"]:
        if not isinstance(self.pages, LayerPages):
            raise ValueError(
                "a layer with per-head keys and values got MLA's latent pool; build the cache "
                "with the model's own init_cache / init_pages"
            )
        pages = LayerPages(self._write(self.pages.k, k), self._write(self.pages.v, v))
        # Written in place before any read: fused into the reads, XLA would keep the old pool
        # alive beside the new one and copy it (a pool-sized copy per layer and step).
        pages = jax.lax.optimization_barrier(pages)
        out = self._attend(q, pages.k, pages.v, window, softcap)
        return out, eqx.tree_at(lambda s: s.pages, self, pages)

    def attend_latent(
        self,
        q: Float[Array, "batch seq heads latent"],
        latent: Float[Array, "batch seq latent"],
        *,
        window: Int[Array, ""] | int | None,
    ) -> tuple[Float[Array, "batch seq heads latent"], "PagedSlot"]:
        if not isinstance(self.pages, LatentPages):
            raise ValueError(
                "an MLA layer got per-head K/V pools; build the cache with the model's own "
                "init_cache / init_pages so that MLA layers get latent pools"
            )
        pool = jax.lax.optimization_barrier(self._write(self.pages.c, latent[:, :, None, :]))
        out = self._attend(q, pool, None, window, None)
        return out, eqx.tree_at(lambda s: s.pages, self, LatentPages(pool))


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
    window is shorter than a row's span; `page_table` `[groups, row_pages]` and `lengths`
    `[groups]` say where each group's row keeps its tokens and how many it holds; `rows`
    `[groups]` which ring row each group owns (None: group g owns ring row g); `segments` how a
    call's tokens form the groups (layers/token_groups.py; None: one group per batch row);
    `kernel` the paged kernel of one-token groups (decode; None: the backend's default,
    `layers.kernels.paged.default_decode_kernel`); `page_size` tokens per page (the
    pools' own, checked; it sizes the rows of a model whose every layer keeps a ring)."""

    layers: PyTree[LayerPages | LatentPages | LayerWindow]
    page_table: Int[Array, "groups row_pages"]
    lengths: Int[Array, " groups"]
    rows: Int[Array, " groups"] | None = None
    segments: Segments | None = eqx.field(static=True, default=None)
    kernel: PagedKernel | None = eqx.field(static=True, default=None)
    page_size: int = eqx.field(static=True, default=16)

    def __check_init__(self):
        pools, _ = pools_and_rings(self.layers)
        sizes = {jax.tree.leaves(pool)[0].shape[-2] for pool in pools}
        if sizes - {self.page_size}:
            raise ValueError(
                f"PagedKVCache page_size={self.page_size} but its pools hold pages of "
                f"{sorted(sizes)} tokens"
            )

    def logical_axes(self) -> dict[str, tuple[str, ...]]:
        return {"page_table": ("batch", "pages"), "lengths": ("batch",), "rows": ("batch",)}

    @property
    def max_len(self) -> int:
        """The most tokens a row holds: its page table's slots."""
        return self.page_table.shape[1] * self.page_size

    def with_layers(self, layers: PyTree[LayerPages | LatentPages | LayerWindow]) -> "PagedKVCache":
        return eqx.tree_at(lambda c: c.layers, self, layers)

    def append(
        self, valid: Bool[Array, "batch seq"], *, sliding_window: Int[Array, ""] | int | None = None
    ) -> Appended:
        """`valid` marks the call's real tokens; each continues its group's row (positions from
        the row's length, in order); the others write nothing and see nothing."""
        batch, seq = valid.shape
        segments = self.segments or ((batch, seq),)
        check_segments(segments, batch, seq, self.page_table.shape[0])
        call = TokenGroups.of(valid, self.lengths, self.rows, segments)
        positions = call.positions.reshape(batch, seq)
        cache = eqx.tree_at(lambda c: c.lengths, self, call.after)
        view = PagedView(self.page_table, call, self.kernel)
        return Appended(cache, positions, causal_mask(positions, sliding_window=sliding_window),
                        view)  # fmt: skip


class PagedView(eqx.Module):
    """`view(layer_arrays, layer)`: one call's `LayerView` of a layer, a `PagedSlot` of its
    pools or a `WindowSlot` of its rings. A module rather than a closure, so a layer traced as a
    program of its own takes the call's page table and token groups as arguments
    (zoo/stack.py's unrolled layers)."""

    page_table: Int[Array, "groups row_pages"]
    call: TokenGroups
    kernel: PagedKernel | None = eqx.field(static=True)

    def __call__(
        self, arrays: LayerPages | LatentPages | LayerWindow, layer: Int[Array, ""] | None
    ) -> "PagedSlot | WindowSlot":
        if isinstance(arrays, LayerWindow):
            return WindowSlot(arrays, layer, self.call)
        return PagedSlot(arrays, layer, self.page_table, self.call, self.kernel)
