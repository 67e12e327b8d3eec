"""The two layout choices behind infer/ on this CPU, measured: how decode should hold the layer
weights (per-layer arrays, `lax.scan` over stacked ones, or an unrolled loop slicing stacked ones)
and the KV cache (stacked or per layer; `[kv_seq, kv_heads]` or `[kv_heads, kv_seq]` order).

    python -m bench.decode_layout

Weights: 12 float32 layers of a 768 -> 3072 -> 768 matrix-vector pair (GPT-2 124M's MLP), batch 1.
Cache: 12 layers, batch 8, 512 slots, 12 heads of 64; each step writes one slot per layer and runs
the xla kernel over the layer's cache in the kernels' `[batch, kv_seq, kv_heads, head_dim]` view.
"""

import statistics
import time

import jax
import jax.numpy as jnp

from layers.kernels import AttentionMask, xla_attention

LAYERS, D, F = 12, 768, 3072
B, S, H, HD = 8, 512, 12, 64


def median_ms(fn, *args, repeats: int = 10) -> float:
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - start)
    return 1e3 * statistics.median(times)


def weights() -> None:
    up = jax.random.normal(jax.random.key(0), (LAYERS, D, F)) * 0.01
    down = jax.random.normal(jax.random.key(1), (LAYERS, F, D)) * 0.01
    x = jnp.ones((1, D))

    def mlp(x, w_up, w_down):
        return x + jnp.tanh(x @ w_up) @ w_down

    def per_layer(x, ups, downs):
        for w_up, w_down in zip(ups, downs, strict=True):
            x = mlp(x, w_up, w_down)
        return x

    def scanned(x, up, down):
        return jax.lax.scan(lambda x, w: (mlp(x, *w), None), x, (up, down))[0]

    def sliced(x, up, down):
        for i in range(LAYERS):
            x = mlp(x, up[i], down[i])
        return x

    n_bytes = up.nbytes + down.nbytes
    split = ([up[i] for i in range(LAYERS)], [down[i] for i in range(LAYERS)])
    for name, fn, args in [
        ("per-layer arrays", per_layer, split),
        ("lax.scan over stacked", scanned, (up, down)),
        ("unrolled, slicing stacked", sliced, (up, down)),
    ]:
        ms = median_ms(jax.jit(fn), x, *args)
        print(f"| weights | {name} | {ms:.1f} | {n_bytes / ms / 1e6:.1f} |", flush=True)


def cache_step(layout: str):
    """One decode step's cache traffic for a layout: write a slot, attend over the layer."""
    per_layer = layout.startswith("per-layer")
    heads_first = layout.endswith("[B,H,S,D]")

    def step(k, v, q, slot):
        mask = AttentionMask(
            q_positions=jnp.full((B, 1), slot), kv_positions=jnp.broadcast_to(jnp.arange(S), (B, S))
        )
        k, v = list(k) if per_layer else k, list(v) if per_layer else v
        for layer in range(LAYERS):
            new = q[:, :, :H] * 0.5
            new = new.transpose(0, 2, 1, 3) if heads_first else new
            start = (0, 0, slot, 0) if heads_first else (0, slot, 0, 0)
            if per_layer:
                k[layer] = jax.lax.dynamic_update_slice(k[layer], new, start)
                v[layer] = jax.lax.dynamic_update_slice(v[layer], new, start)
                kl, vl = k[layer], v[layer]
            else:
                k = jax.lax.dynamic_update_slice(k, new[None], (layer, *start))
                v = jax.lax.dynamic_update_slice(v, new[None], (layer, *start))
                kl, vl = k[layer], v[layer]
            if heads_first:
                kl, vl = kl.transpose(0, 2, 1, 3), vl.transpose(0, 2, 1, 3)
            q = q + xla_attention(q, kl, vl, mask)
        return q, k, v

    return jax.jit(step, donate_argnums=(0, 1))


def cache() -> None:
    for layout in [
        "stacked [L,B,S,H,D]",
        "stacked [L,B,H,S,D]",
        "per-layer [B,S,H,D]",
        "per-layer [B,H,S,D]",
    ]:
        shape = (B, H, S, HD) if layout.endswith("[B,H,S,D]") else (B, S, H, HD)
        if layout.startswith("per-layer"):
            k = [jnp.zeros(shape) for _ in range(LAYERS)]
            v = [jnp.zeros(shape) for _ in range(LAYERS)]
        else:
            k, v = jnp.zeros((LAYERS, *shape)), jnp.zeros((LAYERS, *shape))
        step, q = cache_step(layout), jnp.ones((B, 1, H, HD))
        _, k, v = step(k, v, q, 0)
        times = []
        for i in range(10):
            start = time.perf_counter()
            out, k, v = step(k, v, q, i + 1)
            jax.block_until_ready(out)
            times.append(time.perf_counter() - start)
        ms = 1e3 * statistics.median(times)
        n_bytes = 2 * LAYERS * B * S * H * HD * 4
        print(f"| KV cache | {layout} | {ms:.1f} | {n_bytes / ms / 1e6:.1f} |", flush=True)


if __name__ == "__main__":
    print("| what | layout | ms per step | GB/s |\n|---|---|---|---|")
    weights()
    cache()
