"""Flash attention's tile sizes, Triton launch settings and backward dQ scheme swept on the device,
forward+backward, beside the compute roofline: which `BlockSizes` the defaults should be, read
off a measurement.

    python -m bench flash-blocks

GPU: causal, batch 4, seq 4096, 16 heads (GQA with 4 K/V heads), bfloat16, at head_dim 64
(Llama 3.2 1B) and 128 (Llama 3 8B); the defaults, the defaults with the atomic dQ backward,
then combinations of forward tile (block_q x block_k), backward tile, warps and pipeline
stages (`settings`). Each setting compiles its kernels, so the sweep has a time budget (default
480 s, inside one 10-minute device call), split evenly between the head dims: settings left when
a head dim's share is spent are listed as not run, and the defaults always run first. Each
setting has its own try/except: one that fails to compile (shared memory, registers) is recorded
in its row and the sweep goes on.
CPU: the first two settings at seq 256 in the Pallas interpreter, which checks that the sweep
runs and says nothing about speed.
"""

import dataclasses
import itertools
import time

import jax
import jax.numpy as jnp

from bench.attention import attention_flops
from bench.harness import (
    Ceilings,
    Table,
    error_note,
    median_seconds,
    on_gpu,
    roofline_cells,
)
from layers.kernels import BlockSizes, causal_mask, flash_attention
from layers.kernels.flash.config import DEFAULT_BLOCK_SIZES

BUDGET_S = 480.0


def settings(gpu: bool) -> list[BlockSizes]:
    """The defaults first (so the table starts with the reference), then the defaults with the
    atomic dQ backward (`backward_dq="atomic"`: does it win back its two matmuls?), then the
    sweep, forward tiles varying slowest."""
    atomic = dataclasses.replace(DEFAULT_BLOCK_SIZES, backward_dq="atomic")
    if not gpu:
        return [DEFAULT_BLOCK_SIZES, atomic]
    grid = itertools.product(
        [(128, 64), (64, 64), (128, 128)],  # forward block_q x block_k
        [(64, 64), (32, 64), (64, 128)],  # backward block_q x block_k
        [4, 8],  # num_warps
        [2, 3],  # num_stages
    )
    sweep = [
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
    return [DEFAULT_BLOCK_SIZES, atomic, *(b for b in sweep if b != DEFAULT_BLOCK_SIZES)]


def problem(gpu: bool) -> tuple[int, int, int, int, str, tuple[int, ...]]:
    """(batch, seq, heads, kv_heads, dtype, head_dims) of the sweep."""
    if gpu:
        return 4, 4096, 16, 4, "bfloat16", (64, 128)
    return 1, 256, 4, 2, "float32", (64,)


def run(ceilings: Ceilings, budget_s: float = BUDGET_S) -> Table:
    gpu = on_gpu()
    batch, seq, heads, kv_heads, dtype, head_dims = problem(gpu)
    repeats = 5 if gpu else 1
    peak = ceilings.matmul_flops(dtype)
    table = Table(
        "flash-blocks",
        "Flash attention block sizes (causal, forward+backward)",
        [
            f"batch {batch}, seq {seq}, {heads} query / {kv_heads} K/V heads, {dtype}; ceiling: "
            f"{dtype} matmul {peak / 1e12:.3g} TFLOP/s measured in this run; predicted = FLOPs "
            "(3.5 x the causal forward) / ceiling. `default` marks DEFAULT_BLOCK_SIZES. "
            f"Budget {budget_s:.0f} s."
        ],
    )
    mask = causal_mask(jnp.broadcast_to(jnp.arange(seq), (batch, seq)))
    start = time.monotonic()
    for n, head_dim in enumerate(head_dims):
        deadline = start + budget_s * (n + 1) / len(head_dims)
        keys = jax.random.split(jax.random.key(head_dim), 3)
        q = jax.random.normal(keys[0], (batch, seq, heads, head_dim), dtype)
        k, v = (jax.random.normal(key, (batch, seq, kv_heads, head_dim), dtype) for key in keys[1:])
        flops = 3.5 * attention_flops(batch, heads, seq, head_dim, causal=True)
        for i, blocks in enumerate(settings(gpu)):
            row = {
                "head_dim": head_dim,
                "fwd tile": f"{blocks.block_q}x{blocks.block_k}",
                "bwd tile": f"{blocks.backward_block_q}x{blocks.backward_block_k}",
                "warps": blocks.num_warps,
                "stages": blocks.num_stages,
                "dQ": blocks.backward_dq,
                "default": "yes" if blocks == DEFAULT_BLOCK_SIZES else "",
            }
            measured, note = float("nan"), ""
            if i > 0 and time.monotonic() > deadline:
                note = "not run: budget spent"
            else:
                try:
                    grad = _grad(mask, blocks)
                    qkv = (q, k, v)
                    measured = median_seconds(lambda g=grad, a=qkv: g(*a), repeats=repeats)
                except Exception as error:  # recorded in the row; the sweep goes on
                    note = error_note(error)
            cells = roofline_cells(flops / peak, measured, flops, peak, "TFLOP/s")
            table.add(row | cells | {"note": note})
    return table


def _grad(mask, blocks: BlockSizes):
    def loss(q, k, v):
        return jnp.sum(flash_attention(q, k, v, mask, block_sizes=blocks).astype(jnp.float32))

    return jax.jit(jax.grad(loss, argnums=(0, 1, 2)))
