"""Context-parallel attention: ring vs all-gather K/V over every device (`context` = all of
them), one attention layer forward + backward, measured beside zoo.math's prediction
(`context_attention_costs`, what `python -m training.plan` prints).

    XLA_FLAGS=--xla_force_host_platform_device_count=8 python -m bench context

The prediction takes each device's share of the measured ceilings: the matmul rate and the
memory bandwidth divided by the device count (fake CPU devices share the host's cores and
memory; on a real mesh pass the datasheet's link instead). Fake devices show whether the
kernels' FLOPs and bytes rank them as predicted; they cannot show the ring hiding its hops
under compute, since a "hop" there is a memory copy competing for the same cores.
"""

import jax
import jax.numpy as jnp

import shard
import zoo
from bench.harness import Ceilings, Table, median_seconds, on_gpu
from layers.kernels import AllGatherKV, Ring, causal_mask
from shard.sequence import to_zigzag
from zoo import math as zm


def sizes() -> tuple[zoo.Config, list[int], int]:
    """(config whose attention shapes are used, sequence lengths, repeats) for this device."""
    if on_gpu():
        config = zoo.preset("llama3-1b")
        return config, [8192, 32768], 5
    # GQA 8 query heads / 2 K/V heads of 64: the K/V blocks the ring passes are a quarter of q.
    config = zoo.preset("tiny-llama", d_model=512, n_heads=8, n_kv_heads=2, max_seq_len=8192)
    return config, [1024, 4096], 3


def measure(kernel, config: zoo.Config, seq: int, n: int, repeats: int) -> float:
    """Median seconds of one forward + backward of `kernel` on a batch-1 sequence of `seq`
    tokens split over `n` devices (zig-zag order)."""
    keys = jax.random.split(jax.random.key(0), 3)
    h, kv, d = config.n_heads, config.n_kv_heads, config.head_dim
    q = to_zigzag(jax.random.normal(keys[0], (1, seq, h, d)), n)
    k, v = (to_zigzag(jax.random.normal(key, (1, seq, kv, d)), n) for key in keys[1:])
    mask = causal_mask(to_zigzag(jnp.arange(seq)[None], n))
    placement = shard.Placement(shard.mesh(context=n), shard.rules_for({"context": n}, "dp"))
    q = placement.batch(q, "batch seq heads head_dim")
    k, v = (placement.batch(x, "batch seq kv_heads head_dim") for x in (k, v))

    def loss(q, k, v):
        return jnp.sum(kernel(q, k, v, mask) ** 2)

    with placement.context():
        step = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(q, k, v).compile()
    return median_seconds(lambda: step(q, k, v), repeats=repeats)


def run(ceilings: Ceilings) -> Table:
    config, seqs, repeats = sizes()
    n = len(jax.devices())
    policy = zoo.Policy()
    peak = ceilings.matmul_flops("float32") / (1 if on_gpu() else n)
    link = ceilings.bandwidth() / (1 if on_gpu() else n)
    table = Table(
        "context",
        f"Context-parallel attention over {n} devices: ring vs all-gather K/V (fwd + bwd)",
        [
            f"{config.n_heads} query / {config.n_kv_heads} K/V heads of {config.head_dim}, "
            f"batch 1, float32, causal, zig-zag order. Predicted = zoo.math "
            f"(context_attention_costs) on a per-device share of the ceilings: "
            f"{peak / 1e9:.3g} GFLOP/s, {link / 1e9:.3g} GB/s.",
        ],
    )
    if n < 2:
        table.notes.append(
            "Needs more than one device (on a CPU: "
            "XLA_FLAGS=--xla_force_host_platform_device_count=8); nothing measured."
        )
        return table
    for seq in seqs:
        costs = zm.context_attention_costs(config, policy, batch=1, seq=seq, context=n)
        times = {}
        for cost, kernel in zip(costs, (Ring(), AllGatherKV()), strict=True):
            times[cost.kernel] = measure(kernel, config, seq, n, repeats)
            table.add(
                {
                    "seq": seq,
                    "kernel": cost.kernel,
                    "GFLOP/dev": cost.flops / 1e9,
                    "MiB moved/dev": cost.bytes_moved / 2**20,
                    "MiB held/dev": cost.held_bytes / 2**20,
                    "predicted ms": 1e3 * cost.seconds(peak, link),
                    "measured ms": 1e3 * times[cost.kernel],
                }
            )
        ring, gather = costs
        table.add(
            {
                "seq": seq,
                "kernel": "ring / allgather",
                "GFLOP/dev": ring.flops / gather.flops,
                "MiB moved/dev": ring.bytes_moved / gather.bytes_moved,
                "MiB held/dev": ring.held_bytes / gather.held_bytes,
                "predicted ms": ring.seconds(peak, link) / gather.seconds(peak, link),
                "measured ms": times["ring"] / times["allgather"],
            }
        )
    return table
