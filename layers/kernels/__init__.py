"""Attention kernels behind one interface: `kernel(q, k, v, mask, *, softcap=None) -> out`.

q: [batch, seq, heads, head_dim]; k, v: [batch, kv_seq, kv_heads, head_dim]; mask: AttentionMask.
The functions are `naive_attention` (the specification), `xla_attention`
(jax.nn.dot_product_attention), `flash_attention` (Pallas) and `cudnn_attention` (cuDNN, NVIDIA
GPUs); the objects `Naive()`, `Xla()`, `Flash(block_sizes=...)` and `Cudnn()` are what a model's
policy holds (kernel.py); `Ring()` and `AllGatherKV()` (context.py) attend over a sequence split
across devices (context parallelism). The mask's sliding
window may be a traced per-layer value; `softcap` (Gemma 2's score capping) is refused by xla and
cudnn.

`paged/` is attention over a paged KV pool (a decode step or a prefill chunk against pages):
its own interface, `paged_attention(q, k_pages, v_pages, page_table, lengths, *, q_positions,
sliding_window, softcap, kernel, layer)`, with `XlaPagedKernel()` (XLA: only the blocks of pages
holding visible keys), `PallasDecodeKernel(...)` (GPU) or `CpuDecodeKernel()` (C++, CPU).
"""

from layers.kernels.context import AllGatherKV, Ring
from layers.kernels.cudnn import cudnn_attention
from layers.kernels.flash import BlockSizes, flash_attention
from layers.kernels.kernel import KERNELS, AttentionKernel, Cudnn, Flash, Naive, Xla, kernel_named
from layers.kernels.mask import AttentionMask, causal_mask
from layers.kernels.naive import naive_attention
from layers.kernels.paged import (
    CpuDecodeKernel,
    PallasDecodeKernel,
    XlaPagedKernel,
    check_page_table,
    paged_attention,
    write_pages,
)
from layers.kernels.xla import xla_attention

__all__ = [
    "KERNELS",
    "AllGatherKV",
    "AttentionKernel",
    "AttentionMask",
    "BlockSizes",
    "CpuDecodeKernel",
    "Cudnn",
    "Flash",
    "Naive",
    "PallasDecodeKernel",
    "Ring",
    "Xla",
    "XlaPagedKernel",
    "causal_mask",
    "check_page_table",
    "cudnn_attention",
    "flash_attention",
    "kernel_named",
    "naive_attention",
    "paged_attention",
    "write_pages",
    "xla_attention",
]
