"""What `Transformer.forward` returns."""

import equinox as eqx
from jaxtyping import Array, Float

from layers.moe import MoEStats
from layers.paged_cache import PagedKVCache


class ModelOutput(eqx.Module):
    """`logits` `[batch, seq, vocab]`, or `[n, vocab]` for the n tokens `logits_at` names;
    `aux`: the router statistics of each MoE layer stacked on a leading axis in layer order
    (`Config.moe_layers`; empty arrays for a dense model); `cache`: the KV cache with this
    call's tokens written (None without one); `hidden`: the last layer's output `[batch, seq,
    embed]` before the final norm (unused, it costs nothing under jit; DeepSeek's
    multi-token-prediction module drafts from it, zoo/mtp.py)."""

    logits: Float[Array, "*tokens vocab"]
    aux: MoEStats
    cache: PagedKVCache | None = None
    hidden: Float[Array, "batch seq embed"] | None = None
