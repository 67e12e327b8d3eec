"""The decoder-only transformer: embeddings, a scanned stack of pre-norm blocks, a final norm and
the LM head. GPT-2 (Radford et al. 2019), Llama (Touvron et al. 2023), Mixtral (Jiang et al. 2024)
and DeepSeek-MoE (Dai et al. 2024) are all configs of it."""

import math

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int, PRNGKeyArray

from layers import MLP, Attention, Embedding, LayerNorm, LearnedPositions, Linear, RMSNorm, SwiGLU
from layers.kernels import AttentionMask, causal_mask
from layers.kernels.flash.attention import RESIDUAL_NAMES as FLASH_RESIDUALS
from layers.moe import MoE, MoEStats
from layers.rotary import rotary_frequencies
from shard import constrain
from zoo.config import Config
from zoo.output import ModelOutput

Rope = tuple[Float[Array, "batch seq half"], Float[Array, "batch seq half"]]

_REMAT_POLICIES = {
    "full": jax.checkpoint_policies.nothing_saveable,
    # Keep the weight matmuls' outputs and flash attention's output and log-sum-exp (so backward
    # does not re-run the forward kernel; JAX >= 0.12: 0.11 hides names inside a custom_vjp from
    # the policy); recompute attention scores and elementwise ops.
    "dots": jax.checkpoint_policies.save_from_both_policies(
        jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
        jax.checkpoint_policies.save_only_these_names(*FLASH_RESIDUALS),
    ),
}


def make_norm(config: Config) -> LayerNorm | RMSNorm:
    dtype = config.weight_dtype
    if config.norm == "layernorm":
        return LayerNorm(config.d_model, eps=config.norm_eps, use_bias=config.bias, dtype=dtype)
    return RMSNorm(config.d_model, eps=config.norm_eps, dtype=dtype)


LayerK = Float[Array, "batch kv_heads kv_seq head_dim"]
LayerV = Float[Array, "batch kv_heads head_dim kv_seq"]


class LayerCache(eqx.Module):
    """One layer's keys `[batch, kv_heads, kv_seq, head_dim]` and values `[batch, kv_heads,
    head_dim, kv_seq]`, and the slot where this step's tokens go. infer/ owns the cache; this is
    the part a block needs. Writing touches only the new slots: a donated cache is updated in
    place.

    Both layouts put the dimension that decode attention contracts last: q.k sums over head_dim,
    p.v over kv_seq, so each is a row-major matrix-vector product per (row, K/V head) and a group
    of GQA query heads shares one read of its K/V head. With values `[.., kv_seq, head_dim]` XLA
    contracts p.v over a major dimension: on this CPU the GQA attention of a 512-slot cache ran
    1.5x slower that way (bench/decode_layout.py, bench/RESULTS.md)."""

    k: LayerK
    v: LayerV
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
        layout (views: XLA folds the transposes into the attention products' operand layouts,
        no copy of the cache; checked in the compiled HLO)."""
        new_k = jax.lax.dynamic_update_slice(
            self.k, k.transpose(0, 2, 1, 3).astype(self.k.dtype), (0, 0, self.slot, 0)
        )
        new_v = jax.lax.dynamic_update_slice(
            self.v, v.transpose(0, 2, 3, 1).astype(self.v.dtype), (0, 0, 0, self.slot)
        )
        cache = LayerCache(new_k, new_v, self.slot)
        return cache, new_k.transpose(0, 2, 1, 3), new_v.transpose(0, 3, 1, 2)


class Block(eqx.Module):
    """Pre-norm residual block: x + attn(norm(x)), then x + mlp(norm(x)); with `moe=True` the
    MLP is a mixture of experts, whose router statistics the block returns (None otherwise)."""

    attn_norm: LayerNorm | RMSNorm
    attn: Attention
    mlp_norm: LayerNorm | RMSNorm
    mlp: MLP | SwiGLU | MoE

    def __init__(self, config: Config, *, moe: bool = False, key: PRNGKeyArray):
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
        if moe:
            self.mlp = MoE(
                config.d_model,
                config.expert_d_ff,
                n_experts=config.n_experts,
                n_experts_per_token=config.n_experts_per_token,
                n_shared=config.n_shared_experts,
                dispatch=config.moe_dispatch,
                capacity_factor=config.capacity_factor,
                scoring=config.router_scoring,
                normalize=config.router_normalize,
                out_init_std=out_std,
                dtype=config.weight_dtype,
                key=mlp_key,
            )
            return
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
    ) -> tuple[Float[Array, "batch seq embed"], MoEStats | None, LayerCache | None]:
        """(output, router statistics or None, updated cache or None). With a `cache`, this
        step's keys and values are written into it and attention runs over every cached slot
        (the mask hides the empty ones)."""
        with jax.named_scope("attention"):
            h = self.attn_norm(x)
            if cache is None:
                x = x + self.attn(h, mask, rope)
            else:
                q, k, v = self.attn.project(h, rope)
                cache, k, v = cache.write(k, v)
                x = x + self.attn.attend(q, k, v, mask)
        stats = None
        with jax.named_scope("mlp"):
            if isinstance(self.mlp, MoE):
                y, stats = self.mlp(self.mlp_norm(x))
            else:
                y = self.mlp(self.mlp_norm(x))
            x = x + y
        return constrain(x, "batch seq embed"), stats, cache


def run_stack(
    stack: "Block | BlockGroup",
    x: Float[Array, "batch seq embed"],
    mask: AttentionMask,
    rope: Rope | None,
    *,
    remat: str = "none",
    scan: bool = True,
) -> tuple[Float[Array, "batch seq embed"], MoEStats | None]:
    """Run layers whose weights are stacked on a leading axis, in order: a `lax.scan` (or a
    Python loop over the same weights), each under the remat policy. Returns the output and the
    layers' router statistics stacked on a leading axis (None for dense layers)."""
    dynamic, static = eqx.partition(stack, eqx.is_array)

    def layer(x, weights):
        x, stats, _ = eqx.combine(weights, static)(x, mask, rope)
        return x, stats

    if remat != "none":
        layer = jax.checkpoint(layer, policy=_REMAT_POLICIES[remat])
    if scan:
        return jax.lax.scan(layer, x, dynamic)
    stats = []
    for i in range(jax.tree.leaves(dynamic)[0].shape[0]):
        x, layer_stats = layer(x, jax.tree.map(lambda w, i=i: w[i], dynamic))
        stats.append(layer_stats)
    return x, jax.tree.map(lambda *s: jnp.stack(s), *stats)


class BlockGroup(eqx.Module):
    """`moe_every - 1` dense blocks (stacked, scanned) then one MoE block: the unit that an
    interleaved dense/MoE model stacks and scans, so compile time stays independent of depth.
    Built by `make_blocks` from already stacked blocks (a leading `groups` axis on every leaf)."""

    dense: Block
    moe: Block

    def __call__(
        self, x: Float[Array, "batch seq embed"], mask: AttentionMask, rope: Rope | None
    ) -> tuple[Float[Array, "batch seq embed"], MoEStats | None, None]:
        x, _ = run_stack(self.dense, x, mask, rope)
        return self.moe(x, mask, rope)

    def layers(self) -> tuple[Block, ...]:
        """Each layer's Block in order: the dense ones of every group, then its MoE block."""
        moe = unstack(self.moe)
        dense = [unstack(group) for group in unstack(self.dense)]
        return tuple(
            block for group, last in zip(dense, moe, strict=True) for block in (*group, last)
        )


def unstack(stack: Block | BlockGroup) -> tuple:
    """Slices of weights stacked on a leading axis, as separate modules (copies of the weights)."""
    dynamic, static = eqx.partition(stack, eqx.is_array)
    n = jax.tree.leaves(dynamic)[0].shape[0]
    return tuple(eqx.combine(jax.tree.map(lambda w, i=i: w[i], dynamic), static) for i in range(n))


def make_blocks(config: Config, key: PRNGKeyArray) -> tuple[Block | None, Block | BlockGroup]:
    """(leading dense blocks or None, the main stack). A dense model is one stack of Blocks; an
    MoE model has its `first_dense_layers` apart, then a stack of MoE Blocks (`moe_every == 1`)
    or of BlockGroups."""
    keys = jax.random.split(key, config.n_layers)
    dense_stack = eqx.filter_vmap(lambda k: Block(config, key=k))
    if config.n_experts == 0:
        return None, dense_stack(keys)
    first, every = config.first_dense_layers, config.moe_every
    leading = dense_stack(keys[:first]) if first else None
    moe_keys = keys[jnp.asarray(config.moe_layers)]
    moe = eqx.filter_vmap(lambda k: Block(config, moe=True, key=k))(moe_keys)
    if every == 1:
        return leading, moe
    # Dense layers between MoE layers: build them in one stack, then fold it into groups.
    groups = len(config.moe_layers)
    dense_keys = keys[first:].reshape(groups, every, *keys.shape[1:])[:, :-1]
    dense = dense_stack(dense_keys.reshape(groups * (every - 1), *keys.shape[1:]))
    dense = jax.tree.map(lambda w: w.reshape(groups, every - 1, *w.shape[1:]), dense)
    return leading, BlockGroup(dense=dense, moe=moe)


def positions_from_segments(segment_ids: Int[Array, "batch seq"]) -> Int[Array, "batch seq"]:
    """Position of each token inside its own packed document (restarts at every new segment)."""
    index = jnp.broadcast_to(jnp.arange(segment_ids.shape[1]), segment_ids.shape)
    starts = jnp.concatenate(
        [jnp.ones_like(segment_ids[:, :1], bool), segment_ids[:, 1:] != segment_ids[:, :-1]], axis=1
    )
    return index - jax.lax.cummax(jnp.where(starts, index, 0), axis=1)


class Transformer(eqx.Module):
    """tokens `[batch, seq]` -> logits `[batch, seq, vocab]` (`forward` adds the MoE statistics).

    `blocks` holds every layer's weights stacked on a leading `layers` axis (built with
    `eqx.filter_vmap`) and is run with `lax.scan`, so compile time does not grow with depth.
    In an MoE model `dense_blocks` holds the `first_dense_layers` and `blocks` the rest: MoE
    Blocks, or BlockGroups of `moe_every` layers when dense and MoE layers alternate.
    `unstack_layers()` gives the same model with `blocks` as a tuple of per-layer Blocks, which
    decode on CPU wants (slicing stacked weights inside a step copies them; see infer/).
    """

    embed: Embedding
    positions: LearnedPositions | None
    dense_blocks: Block | None
    blocks: Block | BlockGroup | tuple[Block, ...]
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
        self.dense_blocks, self.blocks = make_blocks(config, blocks_key)
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

    def layers(self) -> tuple[Block, ...]:
        """Each layer's Block in order (slices of the stacked weights, or the unstacked tuple)."""
        if isinstance(self.blocks, tuple):
            return self.blocks
        leading = () if self.dense_blocks is None else unstack(self.dense_blocks)
        if isinstance(self.blocks, BlockGroup):
            return leading + self.blocks.layers()
        return leading + unstack(self.blocks)

    def unstack_layers(self) -> "Transformer":
        """The same model with `blocks` as a tuple of per-layer Blocks (a copy of the weights)."""
        return eqx.tree_at(
            lambda m: (m.dense_blocks, m.blocks),
            self,
            (None, self.layers()),
            is_leaf=lambda node: node is None,
        )

    def run_blocks(
        self, x: Float[Array, "batch seq embed"], mask: AttentionMask, rope: Rope | None
    ) -> tuple[Float[Array, "batch seq embed"], MoEStats]:
        """Every block in order (see `run_stack`; a Python loop for unstacked layers), and the
        MoE layers' statistics stacked on a leading axis (empty for a dense model)."""
        c = self.config
        if isinstance(self.blocks, tuple):
            stats = []
            for block in self.blocks:
                x, layer_stats, _ = block(x, mask, rope)
                stats += [] if layer_stats is None else [layer_stats]
            if not stats:
                return x, MoEStats.empty(c.n_experts)
            return x, jax.tree.map(lambda *s: jnp.stack(s), *stats)
        if self.dense_blocks is not None:
            x, _ = run_stack(self.dense_blocks, x, mask, rope, remat=c.remat, scan=c.scan_layers)
        x, stats = run_stack(self.blocks, x, mask, rope, remat=c.remat, scan=c.scan_layers)
        return x, MoEStats.empty(c.n_experts) if stats is None else stats

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
            x, _, cache = block(x, mask, rope, cache)
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
        """Logits for every position (`forward(...).logits`)."""
        return self.forward(tokens, positions=positions, segment_ids=segment_ids).logits

    def forward(
        self,
        tokens: Int[Array, "batch seq"],
        *,
        positions: Int[Array, "batch seq"] | None = None,
        segment_ids: Int[Array, "batch seq"] | None = None,
    ) -> ModelOutput:
        """Logits for every position and the MoE layers' router statistics. With `segment_ids`
        (packed documents) attention stays inside each document and positions restart per
        document unless given."""
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
        x, aux = self.run_blocks(x, mask, self.rope(positions))
        return ModelOutput(logits=self.logits(x), aux=aux)
