"""The KV cache: every layer's keys and values, preallocated to a maximum length, plus where each
row's tokens sit. Rows fill their slots in lockstep (one shared write slot), so a batch of ragged
prompts is left-padded and each slot carries its row's position and a segment id (1 = a real
token, 0 = empty or padding, invisible to every query)."""

import equinox as eqx
import jax.numpy as jnp
from jax.typing import DTypeLike
from jaxtyping import Array, Float, Int

from layers.kernels import AttentionMask
from zoo.config import Config


class KVCache(eqx.Module):
    """Per layer, keys `[batch, kv_heads, kv_seq, head_dim]` and values `[batch, kv_heads,
    head_dim, kv_seq]`, one array per layer.

    Each choice was measured on this CPU (bench/decode_layout.py, bench/RESULTS.md): one array per
    layer instead of a stacked `[layers, ...]` array (a layer's slice of a stacked array is copied
    inside each step); `kv_heads` before `kv_seq` (each head's keys contiguous); values with
    `kv_seq` last, so p.v, like q.k, contracts the minor dimension (1.5x faster GQA attention over
    a 512-slot cache). The kernels' `[batch, kv_seq, kv_heads, head_dim]` views are transposes XLA
    folds into the attention products (`zoo.transformer.LayerCache`).

    `positions`/`segment_ids` `[batch, kv_seq]` describe each slot for the attention mask;
    `lengths` `[batch]` counts the tokens a row holds (its next position); `slot` is the next
    slot every row writes to.
    """

    k: tuple[Float[Array, "batch kv_heads kv_seq head_dim"], ...]
    v: tuple[Float[Array, "batch kv_heads head_dim kv_seq"], ...]
    positions: Int[Array, "batch kv_seq"]
    segment_ids: Int[Array, "batch kv_seq"]
    lengths: Int[Array, " batch"]
    slot: Int[Array, ""]

    @property
    def max_len(self) -> int:
        return self.positions.shape[1]

    @property
    def batch(self) -> int:
        return self.positions.shape[0]

    def mask(
        self,
        q_positions: Int[Array, "batch seq"],
        q_segment_ids: Int[Array, "batch seq"],
        *,
        sliding_window: int | None = None,
    ) -> AttentionMask:
        """Causal attention from these queries to every slot; empty and padding slots (segment 0)
        are seen by no real query (segment 1)."""
        return AttentionMask(
            q_positions=q_positions,
            kv_positions=self.positions,
            q_segment_ids=q_segment_ids,
            kv_segment_ids=self.segment_ids,
            causal=True,
            sliding_window=sliding_window,
        )


def init_cache(
    config: Config, batch: int, max_len: int, *, dtype: DTypeLike | None = None
) -> KVCache:
    """An empty cache for `batch` rows of up to `max_len` tokens (in the compute dtype unless
    `dtype` is given)."""
    if batch < 1:
        raise ValueError(f"KV cache batch must be >= 1, got {batch}")
    if max_len < 1:
        raise ValueError(f"KV cache max_len must be >= 1, got {max_len}")
    if config.position == "learned" and max_len > config.max_seq_len:
        raise ValueError(
            f"KV cache max_len={max_len} exceeds Config.max_seq_len={config.max_seq_len}, the size "
            "of the learned position table"
        )
    k_shape = (batch, config.n_kv_heads, max_len, config.head_dim)
    v_shape = (batch, config.n_kv_heads, config.head_dim, max_len)
    dtype = dtype or config.compute_dtype
    return KVCache(
        k=tuple(jnp.zeros(k_shape, dtype) for _ in range(config.n_layers)),
        v=tuple(jnp.zeros(v_shape, dtype) for _ in range(config.n_layers)),
        positions=jnp.zeros((batch, max_len), jnp.int32),
        segment_ids=jnp.zeros((batch, max_len), jnp.int32),
        lengths=jnp.zeros((batch,), jnp.int32),
        slot=jnp.zeros((), jnp.int32),
    )
