"""Attention kernels behind one interface: `kernel(q, k, v, mask) -> out`.

q: [batch, seq, heads, head_dim]; k, v: [batch, kv_seq, kv_heads, head_dim]; mask: AttentionMask.
`naive` is the specification; `xla` uses jax.nn.dot_product_attention; `flash` is Pallas.

`paged/` is attention over a paged KV pool (a decode step or a prefill chunk against pages):
its own interface, `paged_attention(q, k_pages, v_pages, page_table, lengths, *, q_positions,
sliding_window, kernel)`, with `GatherKernel()` (XLA) or `PallasDecodeKernel(...)`.
"""

from collections.abc import Callable

from layers.kernels.flash import BlockSizes, flash_attention
from layers.kernels.mask import AttentionMask, causal_mask
from layers.kernels.naive import naive_attention
from layers.kernels.paged import (
    GatherKernel,
    PallasDecodeKernel,
    check_page_table,
    paged_attention,
    write_pages,
)
from layers.kernels.xla import xla_attention

KERNELS: dict[str, Callable] = {
    "naive": naive_attention,
    "xla": xla_attention,
    "flash": flash_attention,
}


def get_kernel(name: str) -> Callable:
    """The kernel called `name`; an unknown or unavailable name is an error, never a fallback."""
    if name not in KERNELS:
        raise ValueError(f"unknown attention kernel {name!r}; known: {sorted(KERNELS)}")
    return KERNELS[name]


__all__ = [
    "KERNELS",
    "AttentionMask",
    "BlockSizes",
    "GatherKernel",
    "PallasDecodeKernel",
    "causal_mask",
    "check_page_table",
    "flash_attention",
    "get_kernel",
    "naive_attention",
    "paged_attention",
    "write_pages",
    "xla_attention",
]
