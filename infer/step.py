"""Prefill (a whole prompt block into the cache) and one decode step, both through the model's own
modules (`Transformer.embed_tokens`, `rope`, `run_blocks_cached`, `logits`), jitted with the cache
donated: the cache is returned, never copied.

Layers run as a Python loop (`Transformer.run_blocks_cached`), never `lax.scan`. Measured on this
CPU (bench/decode_layout.py, bench/RESULTS.md), a float32 matrix-vector stack runs 2.3x slower as
a `lax.scan` over stacked weights and 10x slower as an unrolled loop slicing them than with
per-layer weight arrays (each slice is copied). So pass `model.unstack_layers()` (made once) for
repeated steps; `generate` does that itself.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Bool, Float, Int

from infer.cache import KVCache
from zoo.transformer import LayerCache, Transformer


def forward_cached(
    model: Transformer,
    tokens: Int[Array, "batch seq"],
    valid: Bool[Array, "batch seq"],
    cache: KVCache,
) -> tuple[Float[Array, "batch seq embed"], KVCache]:
    """Final hidden states of `tokens`, written into slots `[slot, slot + seq)` of the cache.

    `valid` marks real tokens (False = padding): a padding slot gets segment id 0 so no real query
    ever sees it, and each row's positions continue from its own length, so left-padded rows of
    different lengths share the batch.
    """
    seq = tokens.shape[1]
    segment_ids = valid.astype(jnp.int32)
    positions = jnp.where(valid, cache.lengths[:, None] + jnp.cumsum(segment_ids, axis=1) - 1, 0)
    cache = KVCache(
        k=cache.k,
        v=cache.v,
        positions=jax.lax.dynamic_update_slice(cache.positions, positions, (0, cache.slot)),
        segment_ids=jax.lax.dynamic_update_slice(cache.segment_ids, segment_ids, (0, cache.slot)),
        lengths=cache.lengths + segment_ids.sum(axis=1),
        slot=cache.slot + seq,
    )
    mask = cache.mask(positions, segment_ids, sliding_window=model.config.sliding_window)
    x = model.embed_tokens(tokens, positions)
    layer_caches = tuple(
        LayerCache(k, v, cache.slot - seq) for k, v in zip(cache.k, cache.v, strict=True)
    )
    x, layer_caches = model.run_blocks_cached(x, mask, model.rope(positions), layer_caches)
    k = tuple(c.k for c in layer_caches)
    v = tuple(c.v for c in layer_caches)
    return x, KVCache(k, v, cache.positions, cache.segment_ids, cache.lengths, cache.slot)


@functools.partial(jax.jit, donate_argnames="cache")
def _prefill(model, tokens, valid, cache):
    x, cache = forward_cached(model, tokens, valid, cache)
    return model.logits(x), cache


@functools.partial(jax.jit, donate_argnames="cache")
def _decode_step(model, token, cache):
    valid = jnp.ones((token.shape[0], 1), bool)
    x, cache = forward_cached(model, token[:, None], valid, cache)
    return model.logits(x)[:, 0], cache


def check_tokens(tokens: np.ndarray, vocab_size: int, what: str) -> None:
    """Token ids must index the vocabulary (an out-of-range id would silently read garbage)."""
    if tokens.size and (tokens.min() < 0 or tokens.max() >= vocab_size):
        bad = tokens[(tokens < 0) | (tokens >= vocab_size)][0]
        raise ValueError(
            f"{what} holds token id {int(bad)} outside the vocabulary [0, {vocab_size})"
        )


def _check_room(cache: KVCache, n: int) -> None:
    slot = int(cache.slot)
    if slot + n > cache.max_len:
        raise ValueError(
            f"{n} new token(s) after {slot} cached ones do not fit the KV cache "
            f"(max_len={cache.max_len}); make a larger cache with init_cache"
        )


def prefill(
    model: Transformer,
    tokens: Int[Array, "batch seq"],
    cache: KVCache,
    *,
    lengths: Int[Array, " batch"] | None = None,
) -> tuple[Float[Array, "batch seq vocab"], KVCache]:
    """Run a prompt block through the model, filling the cache; logits for every position.

    Rows shorter than `seq` are left-padded: `lengths[b]` real tokens sit at the end of row b
    (default: every token is real). The padding's logits are meaningless.
    """
    host = np.asarray(tokens)
    if host.ndim != 2 or host.shape[0] != cache.batch:
        raise ValueError(
            f"prefill tokens must be [batch={cache.batch}, seq], got shape {host.shape}"
        )
    if host.shape[1] == 0:
        raise ValueError("prefill got an empty prompt (seq = 0); give at least one token")
    check_tokens(host, model.config.vocab_size, "prefill tokens")
    _check_room(cache, host.shape[1])
    seq = host.shape[1]
    lengths = np.full(cache.batch, seq) if lengths is None else np.asarray(lengths)
    if lengths.min() < 1 or lengths.max() > seq:
        raise ValueError(f"prefill lengths must be in [1, seq={seq}], got {lengths.tolist()}")
    valid = np.arange(seq)[None, :] >= (seq - lengths)[:, None]
    return _prefill(model, jnp.asarray(host, jnp.int32), jnp.asarray(valid), cache)


def decode_step(
    model: Transformer, token: Int[Array, " batch"], cache: KVCache
) -> tuple[Float[Array, "batch vocab"], KVCache]:
    """One token per row through the model at each row's next position; next-token logits.

    Checks the token ids and the cache's room on the host (one sync); `generate` runs the
    unchecked step inside its on-device loop instead."""
    host = np.asarray(token)
    if host.shape != (cache.batch,):
        raise ValueError(f"decode_step token must be [batch={cache.batch}], got {host.shape}")
    check_tokens(host, model.config.vocab_size, "decode_step token")
    _check_room(cache, 1)
    return _decode_step(model, jnp.asarray(host, jnp.int32), cache)
