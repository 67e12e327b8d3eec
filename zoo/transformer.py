"""The decoder-only transformer: embeddings, the layer stacks, a final norm and the LM head.
GPT-2 (Radford et al. 2019), Llama (Touvron et al. 2023), Mixtral (Jiang et al. 2024),
DeepSeek-MoE (Dai et al. 2024) and Gemma 2/3 (Gemma Team 2024, 2025) are all configs of it.

One forward serves training, prefill and decode: `forward(tokens, ..., cache=None)` takes an
optional paged KV cache (`init_cache`, or the serving engine's) and returns it with this call's
keys and values written."""

import functools
import math
from typing import TYPE_CHECKING

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int, PRNGKeyArray

from layers import (
    Attention,
    Embedding,
    LayerNorm,
    LearnedPositions,
    Linear,
    QuantizedEmbedding,
    QuantizedLinear,
    RMSNorm,
    SwiGLU,
)
from layers.kernels import causal_mask
from layers.kernels.context import CONTEXT_KERNELS
from layers.kernels.naive import soft_cap
from layers.kv_cache import KVCache
from layers.moe import MoEStats
from layers.paged_cache import LatentPages, LayerPages, PagedKVCache, check_kv_dtype
from layers.quantized import PackedWeight
from layers.rotary import rotary_frequencies
from layers.window_cache import LayerWindow
from shard import constrain
from shard.sequence import from_zigzag, sequence_axis, to_zigzag
from zoo.block import Block, Rope, make_norm
from zoo.config import Config
from zoo.output import ModelOutput
from zoo.pattern import LayerPattern
from zoo.pipeline import run_stack
from zoo.policy import Policy, decode_storage
from zoo.stack import Stack, make_stacks

if TYPE_CHECKING:  # zoo/mtp.py builds on Transformer
    from zoo.mtp import MTP

# Some tokens' LM head rows `[n, embed]` as a table (`Transformer.logits(head=)`).
HeadRows = Embedding | QuantizedEmbedding

DEFAULT_POLICY = Policy()


def positions_from_segments(segment_ids: Int[Array, "batch seq"]) -> Int[Array, "batch seq"]:
    """Position of each token inside its own packed document (restarts at every new segment)."""
    index = jnp.broadcast_to(jnp.arange(segment_ids.shape[1]), segment_ids.shape)
    starts = jnp.concatenate(
        [jnp.ones_like(segment_ids[:, :1], bool), segment_ids[:, 1:] != segment_ids[:, :-1]], axis=1
    )
    return index - jax.lax.cummax(jnp.where(starts, index, 0), axis=1)


def _stored(stacks: tuple[Stack, ...], policy: Policy) -> tuple[Stack, ...]:
    """The stacks in the storage and projection layout `policy` asks for (a copy where that
    differs from theirs; the same arrays where it does not)."""
    fusable = lambda n: isinstance(n, (Attention, SwiGLU))  # noqa: E731
    if policy.storage == "unrolled":
        stacks = tuple(stack.unstacked() for stack in stacks)
    else:
        stacks = tuple(stack.restacked() for stack in stacks)
    convert = (lambda n: n.fused()) if policy.fused else (lambda n: n.unfused())
    return jax.tree.map(lambda n: convert(n) if fusable(n) else n, stacks, is_leaf=fusable)


class Transformer(eqx.Module):
    """tokens `[batch, seq]` -> logits `[batch, seq, vocab]` (`forward` adds the MoE statistics
    and the KV cache).

    `config` is the architecture, `policy` how it runs (`with_policy` swaps it). `stacks` hold
    the layers (zoo/stack.py) as `policy.storage` says: weights stacked on a leading axis and
    run by `lax.scan`, or unrolled per layer; `policy.fused` fuses q/k/v and gate/up. `mtp`:
    DeepSeek-V3's multi-token-prediction module (zoo/mtp.py) where the checkpoint has one
    (`load_pretrained`, `with_mtp`), None otherwise; the forward never runs it.
    """

    embed: Embedding | QuantizedEmbedding
    positions: LearnedPositions | None
    stacks: tuple[Stack, ...]
    final_norm: LayerNorm | RMSNorm
    lm_head: Linear | QuantizedLinear | None
    mtp: "MTP | None"
    config: Config = eqx.field(static=True)
    policy: Policy = eqx.field(static=True)

    def __init__(self, config: Config, *, policy: Policy = DEFAULT_POLICY, key: PRNGKeyArray):
        embed_key, pos_key, blocks_key, head_key = jax.random.split(key, 4)
        policy = policy.for_model(config)  # the default kernel resolved, an unfit one refused
        dtype = policy.params
        self.config, self.policy = config, policy
        self.embed = Embedding(config.vocab_size, config.d_model, dtype=dtype, key=embed_key)
        self.positions = (
            LearnedPositions(config.max_seq_len, config.d_model, dtype=dtype, key=pos_key)
            if config.position == "learned"
            else None
        )
        self.stacks = _stored(make_stacks(config, dtype=dtype, key=blocks_key), policy)
        self.final_norm = make_norm(config, dtype)
        self.mtp = None
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

    # --- run-time policy and layer storage -------------------------------------------------

    def with_policy(self, policy: Policy | None = None, **changes) -> "Transformer":
        """The same weights under another policy (`policy`, or this one with `changes`). Only a
        new `param_dtype` (a cast), `storage` (stacking or unstacking the layers) or `fused`
        (fusing or splitting the projections) touches the weights, once: keep the result and
        drop this model. Nothing else is rebuilt. A kernel that cannot compute this model is
        refused here (`Policy.for_model`)."""
        policy = (policy or self.policy).replace(**changes).for_model(self.config)
        model = self
        if policy.param_dtype != self.policy.param_dtype:
            cast = lambda w: w.astype(policy.params) if eqx.is_inexact_array(w) else w  # noqa: E731
            # Packed weights keep their own scale dtypes (layers/quantized/formats.py).
            packed = lambda n: isinstance(n, PackedWeight)  # noqa: E731
            model = jax.tree.map(lambda n: n if packed(n) else cast(n), self, is_leaf=packed)
        if (policy.storage, policy.fused) != (self.policy.storage, self.policy.fused):
            model = eqx.tree_at(lambda m: m.stacks, model, _stored(model.stacks, policy))
        if model.mtp is not None:
            model = eqx.tree_at(lambda m: m.mtp, model, model.mtp.with_policy(policy))
        # A static field: rebuilt from the same leaves (no copy) with the new policy set.
        model = jax.tree.map(lambda leaf: leaf, model)
        object.__setattr__(model, "policy", policy)
        return model

    def for_decode(self, *, sharded: bool = False) -> "Transformer":
        """This model in the layer storage that decodes fastest for its dtypes
        (`zoo.policy.decode_storage`; `sharded`: on a mesh), converted once where it differs;
        unrolled where its layers cannot stack (a GGUF's layers in different block types)."""
        policy = self.policy
        experts = self.config.n_experts > 0
        dtypes = policy.compute_dtype, policy.param_dtype
        storage = decode_storage(*dtypes, sharded=sharded, experts=experts)
        if not all(stack.stackable for stack in self.stacks):
            storage = "unrolled"
        return self.with_policy(storage=storage)

    def with_mtp(self, mtp: "MTP | None") -> "Transformer":
        """This model with `mtp` as its multi-token-prediction module (zoo/mtp.py; None: none),
        which must be made for this config (its width and vocabulary)."""
        if mtp is not None:
            config = mtp.body.config
            if (config.d_model, config.vocab_size) != (self.config.d_model, self.config.vocab_size):
                raise ValueError(
                    f"an MTP module of d_model {config.d_model} and {config.vocab_size} tokens "
                    f"does not fit this model (d_model {self.config.d_model}, "
                    f"{self.config.vocab_size} tokens); make it with MTP(model.config, ...)"
                )
        return eqx.tree_at(lambda m: m.mtp, self, mtp, is_leaf=lambda x: x is None)

    @property
    def is_fused(self) -> bool:
        """Whether the projections are fused (`Policy.fused`)."""
        return self.policy.fused

    def check_unfused(self, what: str) -> None:
        """Refuse a fused model where the per-projection layout is needed."""
        if self.is_fused:
            raise ValueError(
                f"{what} needs the model's separate q/k/v and gate/up projections, but this "
                "model's policy fuses them (Policy.fused); use model.with_policy(fused=False)"
            )

    def layer_location(self, i: int) -> tuple[int, int]:
        """(stack index, index of layer i inside that stack)."""
        if not 0 <= i < self.config.n_layers:
            raise IndexError(f"layer {i} of a {self.config.n_layers}-layer model")
        for s, stack in enumerate(self.stacks):
            if i < stack.n_layers:
                return s, i
            i -= stack.n_layers
        raise AssertionError("the stacks hold fewer layers than the config")

    def layer(self, i: int) -> Block:
        """Layer i's block (slices of stacked weights: a copy)."""
        s, i = self.layer_location(i)
        return self.stacks[s].layer(i)

    # --- the forward pass ------------------------------------------------------------------

    def rope(self, positions: Int[Array, "batch seq"]) -> Rope | None:
        """cos/sin for these positions, shared by every (global) layer (None for learned
        positions)."""
        c = self.config
        if c.position != "rope":
            return None
        return rotary_frequencies(
            positions, head_dim=c.rotary_dim, theta=c.rope_theta, scaling=c.rope_scaling
        )

    def local_rope(self, positions: Int[Array, "batch seq"]) -> Rope | None:
        """cos/sin of the sliding layers' own theta (`local_rope_theta`, unscaled), or None."""
        c = self.config
        if c.local_rope_theta is None:
            return None
        return rotary_frequencies(positions, head_dim=c.head_dim, theta=c.local_rope_theta)

    def init_cache(self, batch: int, max_len: int, *, page_size: int = 16, kv_dtype=None):
        """An empty paged KV cache for `batch` rows of up to `max_len` tokens, each row owning
        its own pages (`max_len` rounded up to whole pages), shaped like the layer storage, in
        the compute dtype unless `kv_dtype` is given (one of `layers.paged_cache.KV_DTYPES`;
        "int8": numbers with a scale per token and K/V head, about half of bfloat16's bytes). A
        layer whose sliding window is shorter than `max_len` keeps a ring of its window instead
        (layers/window_cache.py; in the compute dtype). Decode one-token steps with the
        policy's `decode_kernel`."""
        if batch < 1 or max_len < 1:
            raise ValueError(
                f"a KV cache needs batch >= 1 and max_len >= 1, got {batch}, {max_len}"
            )
        self.config.check_length(max_len, "the KV cache")
        row_pages = -(-max_len // page_size)
        layers = self.init_pages(
            batch * row_pages, page_size, kv_dtype=kv_dtype, rows=batch, span=max_len
        )
        table = jnp.arange(batch * row_pages, dtype=jnp.int32).reshape(batch, row_pages)
        return PagedKVCache(
            layers, table, jnp.zeros(batch, jnp.int32), kernel=self.policy.decode_kernel,
            page_size=page_size,
        )  # fmt: skip

    def init_pages(
        self,
        n_pages: int,
        page_size: int,
        *,
        kv_dtype=None,
        rows: int = 0,
        span: int = 0,
        ring_extra: int = 0,
    ) -> tuple:
        """Empty page pools for a `PagedKVCache` (`layers`), shaped like the layer storage:
        per-head key and value pools, or MLA's one latent pool, in `kv_dtype` (as `init_cache`).
        With `rows` > 0, a layer whose sliding window is shorter than `span` (a row's most
        tokens) keeps a ring of its window (plus `ring_extra` slots) for each of `rows` rows
        instead of pages (layers/window_cache.py), in the compute dtype. A speculating engine's
        rejected drafts (up to `k` tokens past a row's length, rolled back by the length alone)
        overwrite the ring slots of the `k` oldest positions: with `ring_extra = k` those are
        outside every later query's window."""
        c, dtype = self.config, check_kv_dtype(kv_dtype) or self.policy.compute
        if c.mla:
            width = c.mla_kv_rank + c.mla_rope_dim
            full = functools.partial(LatentPages.zeros, n_pages, page_size, width, dtype)
        else:
            full = functools.partial(
                LayerPages.zeros, n_pages, page_size, c.n_kv_heads, c.head_dim, dtype
            )
        return self.cache_layers(full, rows=rows, span=span, ring_extra=ring_extra)

    def cache_layers(self, full, *, rows: int, span: int, dtype=None, ring_extra: int = 0) -> tuple:
        """A cache's per-layer arrays shaped like the layer storage (`Stack.cache_like`): how a
        KV cache or a page pool mirrors the model. `full(layers=...)` makes a layer's
        full-length arrays; a (non-MLA) layer whose window is shorter than `span` gets a ring
        of its window for each of `rows` rows instead (none when `rows` is 0)."""
        c, dtype = self.config, dtype or self.policy.compute

        def make(*, layers, window):
            if rows and not c.mla and window is not None and window + ring_extra < span:
                return LayerWindow.zeros(
                    rows, window + ring_extra, c.n_kv_heads, c.head_dim, dtype, layers=layers
                )
            return full(layers=layers)

        caches, start = [], 0
        for stack in self.stacks:
            caches.append(stack.cache_like(make, c.layer_windows[start : start + stack.n_layers]))
            start += stack.n_layers
        return tuple(caches)

    def logits(
        self, x: Float[Array, "batch seq embed"], *, head: HeadRows | None = None
    ) -> Float[Array, "batch seq vocab"]:
        """Final norm and LM head (the tied embedding matrix when `tie_embeddings`; `head`, a
        table of some tokens' head rows `[n, embed]`, in its place: logits `[..., n]`),
        soft-capped (in float32) when `final_softcap` is set."""
        x = self.final_norm(x)
        if head is not None:
            logits = head.unembed(x)
        elif self.lm_head is None:
            logits = self.embed.unembed(x)
        else:
            logits = self.lm_head(x)
        if self.config.final_softcap is None:
            return logits
        return soft_cap(logits.astype(jnp.float32), self.config.final_softcap).astype(logits.dtype)

    def embed_tokens(self, tokens: Int[Array, "batch seq"]) -> Float[Array, "batch seq embed"]:
        """Token embeddings in the compute dtype, times sqrt(d_model) with `embed_scale` (the
        factor rounded to the weights' dtype first, as HF Gemma does)."""
        x = self.embed(tokens, dtype=self.policy.compute)
        if not self.config.embed_scale:
            return x
        scale = jnp.asarray(math.sqrt(self.config.d_model), self.policy.params)
        return x * scale.astype(self.policy.compute)

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
        cache: KVCache | None = None,
        valid: Bool[Array, "batch seq"] | None = None,
        logits_at: Int[Array, " n"] | None = None,
        embeddings: Float[Array, "batch seq embed"] | None = None,
        head: HeadRows | None = None,
    ) -> ModelOutput:
        """Logits, the MoE layers' router statistics and the updated cache.

        Without a cache: `segment_ids` (packed documents) keep attention inside each document
        and restart positions per document unless `positions` are given.
        With a cache (prefill and decode; layers/kv_cache.py): `valid` marks the real tokens
        (default: all); each continues its row of the cache (positions from the row's length, in
        order) and attends to everything its row holds; the others (padding, idle slots) write
        nothing and see nothing. The cache numbers the tokens: `positions` and `segment_ids`
        are refused.
        `logits_at` `[n]` picks the tokens whose logits to compute, as indices into the tokens
        flattened in row-major order (decode needs one per row): logits `[n, vocab]`; default
        every token, `[batch, seq, vocab]`.
        `embeddings` replace the token embeddings as the first layer's input (`tokens` still
        give the shape): DeepSeek's multi-token-prediction module feeds its projection here.
        `head` scores only some tokens (`logits`; a draft model's cut vocabulary,
        infer/speculative/draft.py): logits over its rows.
        """
        c = self.config
        _, split = sequence_axis()
        if split > 1 and not isinstance(self.policy.attention, CONTEXT_KERNELS):
            raise ValueError(
                f"the sharding rules split the sequence over {split} devices (context "
                f"parallelism) but the attention kernel {self.policy.kernel_name!r} needs whole "
                "sequences; use Policy(attention=Ring()) or AllGatherKV() "
                "(layers/kernels/context.py)"
            )
        pattern = LayerPattern.of(c)
        # With a per-layer pattern each layer sets its own window on the shared mask.
        window = None if pattern is not None else c.sliding_window
        if cache is None:
            if valid is not None:
                raise ValueError(
                    "valid= marks the real tokens of a cached call; without a cache, mark "
                    "padding and packed documents with segment_ids"
                )
            c.check_length(tokens.shape[1], "the sequence")
            if positions is None:
                positions = (
                    positions_from_segments(segment_ids)
                    if segment_ids is not None
                    else jnp.broadcast_to(jnp.arange(tokens.shape[1]), tokens.shape)
                )
            if split > 1:  # context parallelism: the zig-zag order (shard/sequence.py)
                tokens, positions = to_zigzag(tokens, split), to_zigzag(positions, split)
                segment_ids = None if segment_ids is None else to_zigzag(segment_ids, split)
            mask = causal_mask(positions, segment_ids, sliding_window=window)
        else:
            if split > 1:
                raise ValueError(
                    f"the sharding rules split the sequence over {split} devices (context "
                    "parallelism), which a KV cache (prefill, decode) does not support; run "
                    "inference on a mesh without a context axis"
                )
            if positions is not None or segment_ids is not None:
                raise ValueError(
                    "forward with a KV cache numbers the tokens itself (each row continues from "
                    "its cached length): do not pass positions or segment_ids; mark padding "
                    "with valid="
                )
            valid = jnp.ones(tokens.shape, bool) if valid is None else valid
            step = cache.append(valid, sliding_window=window)
            cache, positions, mask = step.cache, step.positions, step.mask
        x = self.embed_tokens(tokens) if embeddings is None else embeddings
        if self.positions is not None:
            x = x + self.positions(positions, dtype=self.policy.compute)
        x = constrain(x, "batch seq embed")
        rope, local_rope = self.rope(positions), self.local_rope(positions)
        stats, layer_caches, start = [], [], 0
        for s, stack in enumerate(self.stacks):
            kv, view = (None, None) if cache is None else (cache.layers[s], step.view)
            rows = None if pattern is None else pattern.layers(start, stack.repeats, stack.period)
            start += stack.n_layers
            x, stack_stats, kv = run_stack(
                stack, x, mask, rope, policy=self.policy, cache=kv, view=view,
                pattern=rows, local_rope=local_rope,
            )  # fmt: skip
            stats += [] if stack_stats is None else [stack_stats]
            layer_caches.append(kv)
        if cache is not None:
            cache = cache.with_layers(tuple(layer_caches))
        if split > 1:
            x = from_zigzag(x, split)
        aux = (
            jax.tree.map(lambda *s: jnp.concatenate(s), *stats)
            if stats
            else MoEStats.empty(c.n_experts)
        )
        if logits_at is None:
            return ModelOutput(logits=self.logits(x, head=head), aux=aux, cache=cache, hidden=x)
        picked = x.reshape(-1, x.shape[-1])[logits_at][None]  # [1, n, embed]
        logits = self.logits(picked, head=head)[0]
        return ModelOutput(logits=logits, aux=aux, cache=cache, hidden=x)
