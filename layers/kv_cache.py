"""The KV cache contract: what the forward pass, the layers and infer/ rely on, declared in full.
One family implements it, the paged cache (layers/paged_cache.py): every layer's keys and values
in pages of a pool (MLA: latents), a sliding layer's ring of its window (layers/window_cache.py),
groups of a call's tokens that each continue one row of the page table.

A cached forward goes through three steps:

1. `cache.append(valid, sliding_window=...) -> Appended`: the call's `[batch, seq]` tokens, of
   which `valid` marks the real ones (padding and idle slots write nothing and see nothing), get
   their positions (each real token continues its group's row from the row's length), the mask
   carrying the model's window, the cache with its bookkeeping advanced, and `view`;
2. each block gets `view(layer_arrays, layer_index)`, a `LayerView`: `attend` (per-head keys and
   values) or `attend_latent` (MLA) writes the layer's new entries and attends over everything
   its rows hold, returning the output and the view whose `arrays` are the layer's cache arrays
   after the write;
3. `cache.with_layers(layers)` puts every layer's arrays back.

A layer's arrays may carry leading stacked dims (`[layers, ...]`), mirroring weights stacked for
`lax.scan`; the view then names the layer it reads and writes (never a copy of the whole layer).
"""

from collections.abc import Callable
from typing import Any, NamedTuple, Protocol, runtime_checkable

from jaxtyping import Array, Bool, Float, Int, PyTree

from layers.kernels.mask import AttentionMask


@runtime_checkable
class LayerView(Protocol):
    """One layer's view of the cache for one call."""

    @property
    def arrays(self) -> PyTree:
        """The layer's cache arrays (after this call's write, on the view `attend` returns)."""
        ...

    def attend(
        self,
        q: Float[Array, "batch seq heads head_dim"],
        k: Float[Array, "batch seq kv_heads head_dim"],
        v: Float[Array, "batch seq kv_heads head_dim"],
        *,
        window: Int[Array, ""] | int | None,
        softcap: float | None = None,
    ) -> tuple[Float[Array, "batch seq heads head_dim"], "LayerView"]:
        """Write this call's keys and values, then attend: each query sees the keys of its row
        at positions <= its own (and within `window`); softcap as the kernels' contract."""
        ...

    def attend_latent(
        self,
        q: Float[Array, "batch seq heads latent"],
        latent: Float[Array, "batch seq latent"],
        *,
        window: Int[Array, ""] | int | None,
    ) -> tuple[Float[Array, "batch seq heads latent"], "LayerView"]:
        """MLA: write this call's latents, then attend with every cached latent as the key and
        the value of one K/V head (layers/mla.py says why values = keys)."""
        ...


class Appended(NamedTuple):
    """What `append` gives the forward pass: the cache with its bookkeeping advanced (layers
    not yet written), the new tokens' positions (-1 for tokens that are not real), the mask
    among the new tokens (carrying the model's sliding window, which the stack may set per
    layer), and `view(layer_arrays, layer_index)`, the `LayerView` each block attends through."""

    cache: Any
    positions: Int[Array, "batch seq"]
    mask: AttentionMask
    view: Callable[[PyTree, Int[Array, ""] | None], LayerView]


@runtime_checkable
class KVCache(Protocol):
    """A KV cache as the forward pass sees it (`layers` shaped like the model's layer storage,
    `Transformer.cache_layers`)."""

    layers: PyTree

    def append(
        self, valid: Bool[Array, "batch seq"], *, sliding_window: Int[Array, ""] | int | None
    ) -> Appended: ...

    def with_layers(self, layers: PyTree) -> "KVCache": ...
