"""Flash attention's tile sizes and Triton launch settings swept on the device, forward+backward,
beside the compute roofline: which `BlockSizes` the defaults should be, read off a measurement.

    python -m bench flash-blocks

GPU: causal, batch 4, seq 4096, 16 heads (GQA with 4 K/V heads), bfloat16, at head_dim 64
(Llama 3.2 1B) and 128 (Llama 3 8B); the defaults, then every combination of forward tile
(block_q x block_k), backward tile, warps and pipeline stages below (24 settings per head_dim).
CPU: two settings at seq 256 in the Pallas interpreter, which checks that the sweep runs and says
nothing about speed.
"""

import itertools

import jax
import jax.numpy as jnp

from bench.attention import attention_flops
from bench.harness import Ceilings, Table, median_seconds, on_gpu, roofline_cells
from layers.kernels import BlockSizes, causal_mask, flash_attention
from layers.kernels.flash.config import DEFAULT_BLOCK_SIZES


def settings() -> list[BlockSizes]:
    """The defaults first (so the table starts with the reference), then the sweep."""
    if not on_gpu():
        return [DEFAULT_BLOCK_SIZES, BlockSizes(block_q=64, block_k=128)]
    grid = itertools.product(
        [(64, 64), (128, 64), (128, 128)],  # forward block_q x block_k
        [(32, 64), (64, 64)],  # backward block_q x block_k
        [4, 8],  # num_warps
        [2, 3],  # num_stages
    )
    return [DEFAULT_BLOCK_SIZES] + [
        BlockSizes(
            block_q=fq,
            block_k=fk,
            backward_block_q=bq,
            backward_block_k=bk,
            num_warps=w,
            num_stages=s,
        )
        for (fq, fk), (bq, bk), w, s in grid
    ]


def run(ceilings: Ceilings) -> Table:
    gpu = on_gpu()
    batch, seq, heads, kv_heads = (4, 4096, 16, 4) if gpu else (1, 256, 4, 2)
    dtype, repeats, head_dims = ("bfloat16", 5, (64, 128)) if gpu else ("float32", 1, (64,))
    peak = ceilings.matmul_flops(dtype)
    table = Table(
        "flash-blocks",
        "Flash attention block sizes (causal, forward+backward)",
        [
            f"batch {batch}, seq {seq}, {heads} query / {kv_heads} K/V heads, {dtype}; ceiling: "
            f"{dtype} matmul {peak / 1e12:.3g} TFLOP/s measured in this run; predicted = FLOPs "
            "(3.5 x the causal forward) / ceiling. `default` marks DEFAULT_BLOCK_SIZES (num_warps "
            "None = 4 for head_dim <= 64, else 8)."
        ],
    )
    mask = causal_mask(jnp.broadcast_to(jnp.arange(seq), (batch, seq)))
    for head_dim in head_dims:
        keys = jax.random.split(jax.random.key(head_dim), 3)
        q = jax.random.normal(keys[0], (batch, seq, heads, head_dim), dtype)
        k, v = (jax.random.normal(key, (batch, seq, kv_heads, head_dim), dtype) for key in keys[1:])
        flops = 3.5 * attention_flops(batch, heads, seq, head_dim, causal=True)
        for blocks in settings():

            def loss(q, k, v, blocks=blocks):
                out = flash_attention(q, k, v, mask, block_sizes=blocks)
                return jnp.sum(out.astype(jnp.float32))

            grad = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))
            measured = median_seconds(lambda g=grad, qkv=(q, k, v): g(*qkv), repeats=repeats)
            row = {
                "head_dim": head_dim,
                "fwd tile": f"{blocks.block_q}x{blocks.block_k}",
                "bwd tile": f"{blocks.backward_block_q}x{blocks.backward_block_k}",
                "warps": blocks.warps(head_dim),
                "stages": blocks.num_stages,
                "default": "yes" if blocks == DEFAULT_BLOCK_SIZES else "",
            }
            table.add(row | roofline_cells(flops / peak, measured, flops, peak, "TFLOP/s"))
    return table
