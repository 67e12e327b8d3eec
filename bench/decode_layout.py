"""The two layout choices behind infer/ on this CPU, measured: how decode should hold the layer
weights (per-layer arrays, `lax.scan` over stacked ones, or an unrolled loop slicing stacked ones)
and the KV cache (stacked or per layer; `[kv_seq, kv_heads]` or `[kv_heads, kv_seq]` order; values
with `head_dim` or `kv_seq` last).

    python -m bench layout

Weights: 12 float32 layers of a 768 -> 3072 -> 768 matrix-vector pair (GPT-2 124M's MLP), batch 1.
Cache: 12 layers, batch 8, 512 slots, 12 heads of 64 (and 12 query heads over 3 KV heads, GQA);
each step writes one slot per layer and runs the xla kernel over the layer's cache in the kernels'
`[batch, kv_seq, kv_heads, head_dim]` view. Values stored `[B,H,D,S]` make p.v contract the minor
dimension, as q.k does with keys `[B,H,S,D]`. The contiguous cache that used this layout is gone:
the paged pool (`[kv_heads, pages, page_size, head_dim]`, layers/kernels/paged/pages.py) serves
every cached call, and `python -m bench engine` measures it against the old engine's numbers.
"""

import jax
import jax.numpy as jnp

from bench.harness import Ceilings, Table, median_seconds, roofline_cells
from layers.kernels import AttentionMask, xla_attention

LAYERS, D, F = 12, 768, 3072
B, S, H, HD = 8, 512, 12, 64
GQA_KV_HEADS = 3
REPEATS = 10


def add(table: Table, what: str, layout: str, seconds: float, n_bytes: int, bandwidth: float):
    row = {"what": what, "layout": layout}
    table.add(row | roofline_cells(n_bytes / bandwidth, seconds, n_bytes, bandwidth, "GB/s"))


def weights(table: Table, bandwidth: float) -> None:
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
        fn = jax.jit(fn)
        seconds = median_seconds(lambda fn=fn, args=args: fn(x, *args), repeats=REPEATS)
        add(table, "weights", name, seconds, n_bytes, bandwidth)


def cache_step(layout: str, kv_heads: int):
    """One decode step's cache traffic for a layout: write a slot, attend over the layer."""
    per_layer = layout.startswith("per-layer")
    heads_first = "[B,H,S,D]" in layout
    v_seq_last = layout.endswith("V [B,H,D,S]")

    def step(k, v, q, slot):
        mask = AttentionMask(
            q_positions=jnp.full((B, 1), slot), kv_positions=jnp.broadcast_to(jnp.arange(S), (B, S))
        )
        k, v = list(k) if per_layer else k, list(v) if per_layer else v
        for layer in range(LAYERS):
            new = q[:, :, :kv_heads] * 0.5
            new_k = new.transpose(0, 2, 1, 3) if heads_first else new
            new_v = new.transpose(0, 2, 3, 1) if v_seq_last else new_k
            start = (0, 0, slot, 0) if heads_first else (0, slot, 0, 0)
            v_start = (0, 0, 0, slot) if v_seq_last else start
            if per_layer:
                k[layer] = jax.lax.dynamic_update_slice(k[layer], new_k, start)
                v[layer] = jax.lax.dynamic_update_slice(v[layer], new_v, v_start)
            else:
                k = jax.lax.dynamic_update_slice(k, new_k[None], (layer, *start))
                v = jax.lax.dynamic_update_slice(v, new_v[None], (layer, *v_start))
            kl, vl = k[layer], v[layer]
            if heads_first:
                kl = kl.transpose(0, 2, 1, 3)
                vl = vl.transpose(0, 3, 1, 2) if v_seq_last else vl.transpose(0, 2, 1, 3)
            q = q + xla_attention(q, kl, vl, mask)
        return q, k, v

    return jax.jit(step, donate_argnums=(0, 1))


def cache(table: Table, bandwidth: float) -> None:
    layouts = [
        ("stacked [L,B,S,H,D]", H),
        ("stacked [L,B,H,S,D]", H),
        ("per-layer [B,S,H,D]", H),
        ("per-layer [B,H,S,D]", H),
        ("per-layer K [B,H,S,D], V [B,H,D,S]", H),
        ("per-layer [B,H,S,D]", GQA_KV_HEADS),
        ("per-layer K [B,H,S,D], V [B,H,D,S]", GQA_KV_HEADS),
    ]
    for layout, kv_heads in layouts:
        k_shape = (B, kv_heads, S, HD) if "[B,H,S,D]" in layout else (B, S, kv_heads, HD)
        v_shape = (B, kv_heads, HD, S) if layout.endswith("V [B,H,D,S]") else k_shape
        if layout.startswith("per-layer"):
            k = [jnp.zeros(k_shape) for _ in range(LAYERS)]
            v = [jnp.zeros(v_shape) for _ in range(LAYERS)]
        else:
            k, v = jnp.zeros((LAYERS, *k_shape)), jnp.zeros((LAYERS, *v_shape))
        step, q = cache_step(layout, kv_heads), jnp.ones((B, 1, H, HD))
        state = [k, v, 0]

        def one_step(step=step, q=q, state=state):
            out, state[0], state[1] = step(state[0], state[1], q, state[2] % S)
            state[2] += 1
            return out

        seconds = median_seconds(one_step, repeats=REPEATS)
        what = "KV cache" if kv_heads == H else f"KV cache, GQA {H}/{kv_heads} heads"
        n_bytes = 2 * LAYERS * B * S * kv_heads * HD * 4
        add(table, what, layout, seconds, n_bytes, bandwidth)


def run(ceilings: Ceilings) -> Table:
    bandwidth = ceilings.bandwidth()
    table = Table(
        "layout",
        "Decode layouts (weights and KV cache, float32)",
        [
            f"Ceiling: bandwidth {bandwidth / 1e9:.3g} GB/s measured in this run "
            "(copy or matvec, the larger); predicted = "
            "bytes read / ceiling."
        ],
    )
    weights(table, bandwidth)
    cache(table, bandwidth)
    return table
