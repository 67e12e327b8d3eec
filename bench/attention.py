"""Attention kernels side by side: naive, xla, flash (Pallas) and, on a GPU, cuDNN through
`jax.nn.dot_product_attention(implementation="cudnn")`. For each sequence length: forward and
forward+backward time, TFLOP/s and the fraction of the matmul rate measured in the same run, and
the memory the naive kernel's float32 score matrix needs.

    python -m bench.attention [--seqs 1024 2048 4096 8192] [--batch 4] [--heads 16]
                              [--kv-heads 16] [--head-dim 128] [--dtype bfloat16] [--no-causal]

FLOPs (predicted work): forward = 4 x batch x heads x seq x kv_seq x head_dim (QK^T and PV),
halved when causal; forward+backward = 3.5 x forward (the backward's five matmuls, without the
recompute of P). On CPU, flash runs in the Pallas interpreter: a correctness path, not a speed
path, so its CPU numbers say nothing about the kernel's GPU speed.
"""

import argparse
import statistics
import time

import jax
import jax.numpy as jnp

from layers.kernels import AttentionMask, causal_mask, get_kernel
from zoo.math import measure_matmul_flops


def cudnn_attention(q, k, v, mask: AttentionMask):
    """cuDNN's fused attention; only the plain causal / bidirectional masks are handed over."""
    return jax.nn.dot_product_attention(q, k, v, is_causal=mask.causal, implementation="cudnn")


def median_seconds(fn, *args, repeats: int) -> float:
    jax.block_until_ready(fn(*args))  # compile and warm up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def attention_flops(batch: int, heads: int, seq: int, head_dim: int, causal: bool) -> float:
    flops = 4.0 * batch * heads * seq * seq * head_dim
    return flops / 2 if causal else flops


def run(args) -> list[dict]:
    on_gpu = jax.default_backend() == "gpu"
    kernels = {name: get_kernel(name) for name in ("naive", "xla", "flash")}
    if on_gpu:
        kernels["cudnn"] = cudnn_attention
    peak = measure_matmul_flops(args.dtype, n=4096 if on_gpu else 1024)
    device = jax.devices()[0]
    print(f"# {device.platform} ({device.device_kind}), {args.dtype}, measured matmul peak "
          f"{peak / 1e12:.3f} TFLOP/s; batch {args.batch}, heads {args.heads}/{args.kv_heads}, "
          f"head_dim {args.head_dim}, causal={args.causal}")  # fmt: skip
    header = (
        "| kernel | seq | naive scores | fwd ms | fwd TFLOP/s | fwd % peak "
        "| fwd+bwd ms | fwd+bwd TFLOP/s | fwd+bwd % peak |"
    )
    print(header)
    print("|" + "---|" * (header.count("|") - 1))
    rows = []
    dtype = jnp.dtype(args.dtype)
    for seq in args.seqs:
        keys = jax.random.split(jax.random.key(seq), 3)
        q = jax.random.normal(keys[0], (args.batch, seq, args.heads, args.head_dim), dtype)
        k = jax.random.normal(keys[1], (args.batch, seq, args.kv_heads, args.head_dim), dtype)
        v = jax.random.normal(keys[2], (args.batch, seq, args.kv_heads, args.head_dim), dtype)
        pos = jnp.broadcast_to(jnp.arange(seq), (args.batch, seq))
        mask = (
            causal_mask(pos)
            if args.causal
            else AttentionMask(q_positions=pos, kv_positions=pos, causal=False)
        )
        fwd_flops = attention_flops(args.batch, args.heads, seq, args.head_dim, args.causal)
        score_bytes = 4 * args.batch * args.heads * seq * seq
        for name, kernel in kernels.items():
            if name == "naive" and score_bytes > args.naive_limit_gib * 2**30:
                print(f"| {name} | {seq} | {score_bytes / 2**30:.1f} GiB | skipped: scores "
                      f"exceed --naive-limit-gib={args.naive_limit_gib} | | | | | |")  # fmt: skip
                continue

            def forward(q, k, v, kernel=kernel, mask=mask):
                return kernel(q, k, v, mask)

            def loss(q, k, v, kernel=kernel, mask=mask):
                return jnp.sum(kernel(q, k, v, mask).astype(jnp.float32))

            fwd_s = median_seconds(jax.jit(forward), q, k, v, repeats=args.repeats)
            bwd_s = median_seconds(
                jax.jit(jax.grad(loss, argnums=(0, 1, 2))), q, k, v, repeats=args.repeats
            )
            row = {
                "kernel": name,
                "seq": seq,
                "fwd_s": fwd_s,
                "fwd_tflops": fwd_flops / fwd_s / 1e12,
                "fwd_bwd_s": bwd_s,
                "fwd_bwd_tflops": 3.5 * fwd_flops / bwd_s / 1e12,
            }
            rows.append(row)
            print(f"| {name} | {seq} | {score_bytes / 2**20:.4g} MiB | {1e3 * fwd_s:.2f} "
                  f"| {row['fwd_tflops']:.3f} | {100 * row['fwd_tflops'] * 1e12 / peak:.1f} "
                  f"| {1e3 * bwd_s:.2f} | {row['fwd_bwd_tflops']:.3f} "
                  f"| {100 * row['fwd_bwd_tflops'] * 1e12 / peak:.1f} |", flush=True)  # fmt: skip
    return rows


def main():
    on_gpu = jax.default_backend() == "gpu"
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seqs", type=int, nargs="+", default=None)
    parser.add_argument("--batch", type=int, default=4 if on_gpu else 1)
    parser.add_argument("--heads", type=int, default=16 if on_gpu else 4)
    parser.add_argument("--kv-heads", type=int, default=None, help="default: --heads (MHA)")
    parser.add_argument("--head-dim", type=int, default=128 if on_gpu else 64)
    parser.add_argument("--dtype", default="bfloat16" if on_gpu else "float32")
    parser.add_argument("--no-causal", dest="causal", action="store_false")
    parser.add_argument("--repeats", type=int, default=10 if on_gpu else 3)
    parser.add_argument("--naive-limit-gib", type=float, default=16.0)
    args = parser.parse_args()
    args.seqs = args.seqs or ([1024, 2048, 4096, 8192, 16384] if on_gpu else [128, 256, 512])
    args.kv_heads = args.kv_heads or args.heads
    run(args)


if __name__ == "__main__":
    main()
