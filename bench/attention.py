"""Attention kernels side by side: naive, xla, flash (Pallas) and, on a GPU, cuDNN through
`jax.nn.dot_product_attention(implementation="cudnn")`. For each sequence length: forward and
forward+backward time beside the compute roofline (FLOPs over the matmul rate measured in this
run), and the memory the naive kernel's float32 score matrix needs.

    python -m bench attention

FLOPs: forward = 4 x batch x heads x seq x kv_seq x head_dim (QK^T and PV), halved when causal;
forward+backward = 3.5 x forward (the backward's five matmuls, without the recompute of P). On
CPU, flash runs in the Pallas interpreter: a correctness path, not a speed path, so its CPU
numbers say nothing about the kernel's GPU speed.
"""

import jax
import jax.numpy as jnp

from bench.harness import Ceilings, Table, median_seconds, on_gpu, roofline_cells
from layers.kernels import AttentionMask, causal_mask, get_kernel

NAIVE_LIMIT_BYTES = 16 * 2**30


def cudnn_attention(q, k, v, mask: AttentionMask):
    """cuDNN's fused attention; only the plain causal / bidirectional masks are handed over."""
    return jax.nn.dot_product_attention(q, k, v, is_causal=mask.causal, implementation="cudnn")


def attention_flops(batch: int, heads: int, seq: int, head_dim: int, causal: bool) -> float:
    flops = 4.0 * batch * heads * seq * seq * head_dim
    return flops / 2 if causal else flops


def run(ceilings: Ceilings) -> Table:
    if on_gpu():
        batch, heads, head_dim, dtype, repeats = 4, 16, 128, "bfloat16", 10
        seqs = [1024, 2048, 4096, 8192, 16384]
    else:
        batch, heads, head_dim, dtype, repeats = 1, 4, 64, "float32", 2
        seqs = [128, 256]
    kernels = {name: get_kernel(name) for name in ("naive", "xla", "flash")}
    if on_gpu():
        kernels["cudnn"] = cudnn_attention
    peak = ceilings.matmul_flops(dtype)
    table = Table(
        "attention",
        "Attention kernels (causal)",
        [
            f"batch {batch}, {heads} heads of {head_dim}, {dtype}; ceiling: {dtype} matmul "
            f"{peak / 1e12:.3g} TFLOP/s measured in this run; predicted = FLOPs / ceiling."
        ],
    )
    for seq in seqs:
        keys = jax.random.split(jax.random.key(seq), 3)
        q, k, v = (jax.random.normal(key, (batch, seq, heads, head_dim), dtype) for key in keys)
        mask = causal_mask(jnp.broadcast_to(jnp.arange(seq), (batch, seq)))
        fwd_flops = attention_flops(batch, heads, seq, head_dim, causal=True)
        score_bytes = 4 * batch * heads * seq * seq
        for name, kernel in kernels.items():
            if name == "naive" and score_bytes > NAIVE_LIMIT_BYTES:
                continue  # its score matrix alone would not fit

            def forward(q, k, v, kernel=kernel, mask=mask):
                return kernel(q, k, v, mask)

            def loss(q, k, v, kernel=kernel, mask=mask):
                return jnp.sum(kernel(q, k, v, mask).astype(jnp.float32))

            forward, grad = jax.jit(forward), jax.jit(jax.grad(loss, argnums=(0, 1, 2)))
            for pass_, fn, flops in [
                ("fwd", forward, fwd_flops),
                ("fwd+bwd", grad, 3.5 * fwd_flops),
            ]:
                measured = median_seconds(lambda fn=fn, qkv=(q, k, v): fn(*qkv), repeats=repeats)
                row = {
                    "kernel": name,
                    "seq": seq,
                    "pass": pass_,
                    "naive scores MiB": score_bytes / 2**20,
                }
                table.add(row | roofline_cells(flops / peak, measured, flops, peak, "TFLOP/s"))
    return table
