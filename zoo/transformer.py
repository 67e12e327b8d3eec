"""The decoder-only transformer: embeddings, a scanned stack of pre-norm blocks, a final norm and
the LM head. GPT-2 (Radford et al. 2019) and Llama (Touvron et al. 2023) are both configs of it."""

import math

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int, PRNGKeyArray

from layers import MLP, Attention, Embedding, LayerNorm, LearnedPositions, Linear, RMSNorm, SwiGLU
from layers.kernels import AttentionMask, causal_mask
from layers.rotary import rotary_frequencies
from shard import constrain
from zoo.config import Config

Rope = tuple[Float[Array, "batch seq half"], Float[Array, "batch seq half"]]
LayerKV = Float[Array, "batch kv_heads kv_seq head_dim"]

_REMAT_POLICIES = {
    "full": jax.checkpoint_policies.nothing_saveable,
    # Keep the weight matmuls' outputs, recompute attention scores and elementwise ops.
    "dots": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
}


def make_norm(config: Config) -> LayerNorm | RMSNorm:
    dtype = config.weight_dtype
    if config.norm == "layernorm":
        return LayerNorm(config.d_model, eps=config.norm_eps, use_bias=config.bias, dtype=dtype)
    return RMSNorm(config.d_model, eps=config.norm_eps, dtype=dtype)


class LayerCache(eqx.Module):
    """One layer's keys and values (`[batch, kv_heads, kv_seq, head_dim]`, the layout decode reads
    fastest on CPU) and the slot where this step's tokens go. infer/ owns the cache; this is the
    part a block needs. Writing touches only the new slots: a donated cache is updated in place."""

    k: LayerKV
    v: LayerKV
    slot: Int[Array, ""]

    def write(
        self,
        k: Float[Array, "batch seq kv_heads head_dim"],
        v: Float[Array, "batch seq kv_heads head_dim"],
    ) -> tuple[
        "LayerCache",
        Float[Array, "batch kv_seq kv_heads head_dim"],
        Float[Array, "batch kv_seq kv_heads head_dim"],
    ]:
        """Store this step's k, v at `slot`; return the cache and all its k, v in the kernels'
        layout (XLA folds the transposes into the attention products)."""
        start = (0, 0, self.slot, 0)
        new_k = jax.lax.dynamic_update_slice(
            self.k, k.transpose(0, 2, 1, 3).astype(self.k.dtype), start
        )
        new_v = jax.lax.dynamic_update_slice(
            self.v, v.transpose(0, 2, 1, 3).astype(self.v.dtype), start
        )
        cache = LayerCache(new_k, new_v, self.slot)
        return cache, new_k.transpose(0, 2, 1, 3), new_v.transpose(0, 2, 1, 3)


class Block(eqx.Module):
    """Pre-norm residual block: x + attn(norm(x)), then x + mlp(norm(x))."""

    attn_norm: LayerNorm | RMSNorm
    attn: Attention
    mlp_norm: LayerNorm | RMSNorm
    mlp: MLP | SwiGLU

    def __init__(self, config: Config, *, key: PRNGKeyArray):
        attn_key, mlp_key = jax.random.split(key)
        # GPT-2's scaled init of residual projections: std / sqrt(2 * n_layers).
        out_std = 1.0 / math.sqrt(config.d_model * 2 * config.n_layers)
        self.attn_norm = make_norm(config)
        self.attn = Attention(
            config.d_model,
            n_heads=config.n_heads,
            n_kv_heads=config.n_kv_heads,
            head_dim=config.head_dim,
            kernel=config.attention,
            qk_norm=config.qk_norm,
            norm_eps=config.norm_eps,
            use_bias=config.bias,
            out_init_std=out_std,
            dtype=config.weight_dtype,
            key=attn_key,
        )
        self.mlp_norm = make_norm(config)
        mlp_cls = SwiGLU if config.mlp == "swiglu" else MLP
        self.mlp = mlp_cls(
            config.d_model,
            config.d_ff,
            use_bias=config.bias,
            out_init_std=out_std,
            dtype=config.weight_dtype,
            key=mlp_key,
        )

    def __call__(
        self,
        x: Float[Array, "batch seq embed"],
        mask: AttentionMask,
        rope: Rope | None,
        cache: LayerCache | None = None,
    ) -> Float[Array, "batch seq embed"] | tuple[Float[Array, "batch seq embed"], LayerCache]:
        """With a `cache`, this step's keys and values are written into it and attention runs over
        every cached slot (the mask hides the empty ones); the updated cache is returned too."""
        with jax.named_scope("attention"):
            h = self.attn_norm(x)
            if cache is None:
                x = x + self.attn(h, mask, rope)
            else:
                q, k, v = self.attn.project(h, rope)
                cache, k, v = cache.write(k, v)
                x = x + self.attn.attend(q, k, v, mask)
        with jax.named_scope("mlp"):
            x = x + self.mlp(self.mlp_norm(x))
        x = constrain(x, "batch seq embed")
        return x if cache is None else (x, cache)


def positions_from_segments(segment_ids: Int[Array, "batch seq"]) -> Int[Array, "batch seq"]:
    """Position of each token inside its own packed document (restarts at every new segment)."""
    index = jnp.broadcast_to(jnp.arange(segment_ids.shape[1]), segment_ids.shape)
    starts = jnp.concatenate(
        [jnp.ones_like(segment_ids[:, :1], bool), segment_ids[:, 1:] != segment_ids[:, :-1]], axis=1
    )
    return index - jax.lax.cummax(jnp.where(starts, index, 0), axis=1)


class Transformer(eqx.Module):
    """tokens `[batch, seq]` -> logits `[batch, seq, vocab]`.

    `blocks` holds every layer's weights stacked on a leading `layers` axis (built with
    `eqx.filter_vmap`) and is run with `lax.scan`, so compile time does not grow with depth.
    `unstack_layers()` gives the same model with a tuple of per-layer blocks instead, which decode
    on CPU wants (slicing stacked weights inside a step copies them; see infer/).
    """

    embed: Embedding
    positions: LearnedPositions | None
    blocks: Block | tuple[Block, ...]
    final_norm: LayerNorm | RMSNorm
    lm_head: Linear | None
    config: Config = eqx.field(static=True)

    def __init__(self, config: Config, *, key: PRNGKeyArray):
        embed_key, pos_key, blocks_key, head_key = jax.random.split(key, 4)
        dtype = config.weight_dtype
        self.config = config
        self.embed = Embedding(config.vocab_size, config.d_model, dtype=dtype, key=embed_key)
        self.positions = (
            LearnedPositions(config.max_seq_len, config.d_model, dtype=dtype, key=pos_key)
            if config.position == "learned"
            else None
        )
        layer_keys = jax.random.split(blocks_key, config.n_layers)
        self.blocks = eqx.filter_vmap(lambda k: Block(config, key=k))(layer_keys)
        self.final_norm = make_norm(config)
        self.lm_head = (
            None
            if config.tie_embeddings
            else Linear(
                config.d_model,
                config.vocab_size,
                axes=("embed", "vocab"),
                dtype=dtype,
                key=head_key,
            )
        )

    def unstack_layers(self) -> "Transformer":
        """The same model with `blocks` as a tuple of per-layer Blocks (a copy of the weights)."""
        return eqx.tree_at(lambda m: m.blocks, self, self.layers())

    def layers(self) -> tuple[Block, ...]:
        """Each layer's Block: the tuple itself, or slices of the stacked weights."""
        if isinstance(self.blocks, tuple):
            return self.blocks
        dynamic, static = eqx.partition(self.blocks, eqx.is_array)
        return tuple(
            eqx.combine(jax.tree.map(lambda w, i=i: w[i], dynamic), static)
            for i in range(self.config.n_layers)
        )

    def rope(self, positions: Int[Array, "batch seq"]) -> Rope | None:
        """cos/sin for these positions, shared by every layer (None for learned positions)."""
        if self.config.position != "rope":
            return None
        c = self.config
        return rotary_frequencies(
            positions, head_dim=c.head_dim, theta=c.rope_theta, scaling=c.rope_scaling
        )

    def embed_tokens(
        self, tokens: Int[Array, "batch seq"], positions: Int[Array, "batch seq"]
    ) -> Float[Array, "batch seq embed"]:
        dtype = self.config.compute_dtype
        x = self.embed(tokens, dtype=dtype)
        if self.positions is not None:
            x = x + self.positions(positions, dtype=dtype)
        return constrain(x, "batch seq embed")

    def run_blocks(
        self, x: Float[Array, "batch seq embed"], mask: AttentionMask, rope: Rope | None
    ) -> Float[Array, "batch seq embed"]:
        """Every block in order: a `lax.scan` over the stacked weights (or a Python loop over the
        layers when `config.scan_layers` is False or the layers are unstacked), each under the
        remat policy."""

        def layer(x, block):
            return block(x, mask, rope)

        if self.config.remat != "none":
            layer = jax.checkpoint(layer, policy=_REMAT_POLICIES[self.config.remat])
        if self.config.scan_layers and not isinstance(self.blocks, tuple):
            dynamic, static = eqx.partition(self.blocks, eqx.is_array)
            step = lambda h, w: (layer(h, eqx.combine(w, static)), None)  # noqa: E731
            x, _ = jax.lax.scan(step, x, dynamic)
            return x
        for block in self.layers():
            x = layer(x, block)
        return x

    def run_blocks_cached(
        self,
        x: Float[Array, "batch seq embed"],
        mask: AttentionMask,
        rope: Rope | None,
        caches: tuple[LayerCache, ...],
    ) -> tuple[Float[Array, "batch seq embed"], tuple[LayerCache, ...]]:
        """Every block with its layer's KV cache, as a Python loop over the layers (decode on CPU:
        measured faster than `lax.scan`, fastest with `unstack_layers()`; see infer/step.py)."""
        new_caches = []
        for block, cache in zip(self.layers(), caches, strict=True):
            x, cache = block(x, mask, rope, cache)
            new_caches.append(cache)
        return x, tuple(new_caches)

    def logits(self, x: Float[Array, "batch seq embed"]) -> Float[Array, "batch seq vocab"]:
        """Final norm and LM head (the tied embedding matrix when `tie_embeddings`)."""
        x = self.final_norm(x)
        if self.lm_head is None:
            return self.embed.unembed(x)
        return self.lm_head(x)

    def __call__(
        self,
        tokens: Int[Array, "batch seq"],
        *,
        positions: Int[Array, "batch seq"] | None = None,
        segment_ids: Int[Array, "batch seq"] | None = None,
    ) -> Float[Array, "batch seq vocab"]:
        """Logits for every position. With `segment_ids` (packed documents) attention stays inside
        each document and positions restart per document unless given."""
        seq = tokens.shape[1]
        if self.config.position == "learned" and seq > self.config.max_seq_len:
            raise ValueError(
                f"sequence length {seq} exceeds Config.max_seq_len={self.config.max_seq_len}, "
                "the size of the learned position table"
            )
        if positions is None:
            positions = (
                positions_from_segments(segment_ids)
                if segment_ids is not None
                else jnp.broadcast_to(jnp.arange(seq), tokens.shape)
            )
        mask = causal_mask(positions, segment_ids, sliding_window=self.config.sliding_window)
        x = self.embed_tokens(tokens, positions)
        x = self.run_blocks(x, mask, self.rope(positions))
        return self.logits(x)
