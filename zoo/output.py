"""What `Transformer.forward` returns."""

import equinox as eqx
from jaxtyping import Array, Float

from layers.kv_cache import KVCache
from layers.moe import MoEStats
from layers.paged_cache import PagedKVCache


class ModelOutput(eqx.Module):
    """`logits` `[batch, n, vocab]` (n = seq, or the number of positions asked for with
    `logits_at`); `aux`: the router statistics of each MoE layer stacked on a leading axis in
    layer order (`Config.moe_layers`; empty arrays for a dense model); `cache`: the KV cache
    with this call's tokens written (None without one)."""

    logits: Float[Array, "batch n vocab"]
    aux: MoEStats
    cache: KVCache | PagedKVCache | None = None
