"""Paged attention on a CPU (paged.cc): each (query token, K/V head) of a decode step or a
prompt chunk reads its visible keys and values in place from the pool through its row's page
table, for the whole group of query heads that share them, with an online softmax: a token's
output is the same bits whatever else the call holds. The XLA path's walk (blocked.py)
gathers each block of pages into a copy and transposes it before XLA:CPU's batched products;
bench/RESULTS.md, "Paged attention in C++ on a CPU", has the two side by side.
`layers.kernels.paged.CpuDecodeKernel` names it; it is a CPU's default where it serves the call
(`default_decode_kernel`)."""

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, Int

from layers.kernels.cpu import PAGED_TARGET, WALKS, ensure_built


def cpu_paged_decode(
    q: Float[Array, "batch seq heads head_dim"],
    k_pages: Float[Array, "*layers kv_heads pages page_size head_dim"],
    v_pages: Float[Array, "*layers kv_heads pages page_size head_dim"] | None,
    page_table: Int[Array, "batch row_pages"],
    lengths: Int[Array, " batch"],
    q_positions: Int[Array, "batch seq"],
    sliding_window: Int[Array, ""] | int | None,
    softcap: float | None,
    layer: Int[Array, ""] | None,
    *,
    walk: str = "fastest",
) -> Float[Array, "batch seq heads head_dim"]:
    """`paged_attention` for a decode step or prompt chunks, by paged.cc (arguments as there,
    already checked; `v_pages=None`: the values are the keys). `walk`: "fastest" the running
    CPU's fastest build (AVX-512, else AVX2, else plain C++), "avx2" or "portable" that build
    (a test of each; `layers.kernels.cpu.WALKS`). Under vmap the mapped calls run one after
    another."""
    if walk not in WALKS:
        raise ValueError(f"cpu_paged_decode walk must be one of {WALKS}, got {walk!r}")
    ensure_built()
    window = 0 if sliding_window is None else sliding_window
    call = jax.ffi.ffi_call(
        PAGED_TARGET, jax.ShapeDtypeStruct(q.shape, jnp.float32), vmap_method="sequential"
    )
    return call(
        q,
        k_pages,
        k_pages if v_pages is None else v_pages,
        page_table.astype(jnp.int32),
        lengths.astype(jnp.int32),
        q_positions.astype(jnp.int32),
        jnp.asarray(0 if layer is None else layer, jnp.int32),
        jnp.asarray(window, jnp.int32),
        softcap=np.float32(softcap or 0.0),
        walk=np.int32(WALKS.index(walk)),
    )
