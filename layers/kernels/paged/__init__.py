"""Paged attention: the KV cache as a pool of fixed-size pages with a page table per row (vLLM's
PagedAttention, Kwon et al. 2023), so memory follows the tokens each request actually holds.

- `int8.py`: int8 pools (`Int8Pages`: numbers and a scale per token and K/V head), written
  quantized by `write_pages` and read by both kernels without dequantizing them in memory.
- `pages.py`: the pool layout, the visibility rule, `write_pages` (scatter new keys/values in
  place) and `check_page_table` (host-side check of a table's values).
- `attention.py`: `paged_attention(q, k_pages, v_pages, page_table, lengths, *, q_positions,
  sliding_window, softcap, kernel, layer)` and the three kernel choices, `XlaPagedKernel()`,
  `PallasDecodeKernel(...)` and `CpuDecodeKernel()` (or None: the backend's default,
  `default_decode_kernel`).
- `blocked.py`: the XLA path (an online softmax over the blocks of pages that hold visible keys);
  any backend, any seq.
- `decode.py`: the Pallas decode kernel (seq == 1; GPU through Triton, interpreted on CPU).
- layers/kernels/cpu/paged.cc: the C++ decode kernel (seq == 1, float32, CPU).
"""

from layers.kernels.paged.attention import (
    CpuDecodeKernel,
    PagedKernel,
    PallasDecodeKernel,
    XlaPagedKernel,
    paged_attention,
)
from layers.kernels.paged.int8 import Int8Pages
from layers.kernels.paged.pages import Pool, check_page_table, visible, write_pages

__all__ = [
    "CpuDecodeKernel",
    "Int8Pages",
    "PagedKernel",
    "PallasDecodeKernel",
    "Pool",
    "XlaPagedKernel",
    "check_page_table",
    "paged_attention",
    "visible",
    "write_pages",
]
