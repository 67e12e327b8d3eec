"""`generate`: ragged prompts in one left-padded batch, one prefill, then the whole decode loop on
device (`lax.while_loop`), stopping early once every row has emitted a stop token, with optional
host streaming of the new tokens in chunks. With a mesh and sharding rules the weights, the
prompts and the KV cache are placed by their logical axes and every activation constraint of the
model applies (shard/)."""

import itertools
from collections.abc import Callable, Sequence

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh
from jaxtyping import Array, ArrayLike, Bool, Int, PRNGKeyArray

import shard
from infer.cache import KVCache, init_cache
from infer.sampling import Sampler
from infer.step import check_tokens, forward_cached
from shard.rules import check_divisible
from zoo.transformer import Transformer

# A slot of the output buffer that holds no token (the row had stopped).
NO_TOKEN = -1

OnTokens = Callable[[list[list[int]]], None]


class _Stream:
    """Host side of streaming: forwards each row's not-yet-seen tokens to `on_tokens`. Every
    callback carries the whole output buffer and its fill count, so late or repeated callbacks
    are harmless."""

    def __init__(self, on_tokens: OnTokens):
        self.on_tokens = on_tokens
        self.sent = 0

    def emit(self, out: np.ndarray, n: int) -> None:
        if n <= self.sent:
            return
        chunk = [[int(t) for t in row if t != NO_TOKEN] for row in out[:, self.sent : n]]
        self.sent = n
        self.on_tokens(chunk)


# Live streams by id: the id is an argument of the compiled program, so a new listener does not
# recompile it.
_STREAMS: dict[int, _Stream] = {}
_stream_ids = itertools.count()


def _emit(
    stream_id: Int[ArrayLike, ""], out: Int[ArrayLike, "batch new"], n: Int[ArrayLike, ""]
) -> None:
    stream = _STREAMS.get(int(stream_id))
    if stream is not None:
        stream.emit(np.asarray(out), int(n))


def _constrain_cache(cache: KVCache) -> KVCache:
    """Pin each layer's keys and values to the cache's logical axes (a no-op without rules)."""
    return eqx.tree_at(
        lambda c: (c.k, c.v),
        cache,
        (
            tuple(shard.constrain(k, "batch kv_heads kv_seq head_dim") for k in cache.k),
            tuple(shard.constrain(v, "batch kv_heads head_dim kv_seq") for v in cache.v),
        ),
    )


@eqx.filter_jit
def _generate(
    model: Transformer,
    tokens: Int[Array, "batch seq"],
    valid: Bool[Array, "batch seq"],
    key: PRNGKeyArray,
    stop_tokens: Int[Array, " n_stop"],
    stream_id: Int[Array, ""],
    sampler: Sampler,
    max_new_tokens: int,
    max_len: int,
    chunk_size: int | None,
    sharding: tuple[shard.ShardingRules, Mesh] | None,
) -> tuple[Int[Array, "batch new"], Int[Array, ""]]:
    if sharding is None:
        return _decode(model, tokens, valid, key, stop_tokens, stream_id, sampler,
                       max_new_tokens, max_len, chunk_size)  # fmt: skip
    # Inside the trace, so every `constrain` of the model and the cache sees these rules.
    with shard.use_rules(*sharding):
        return _decode(model, tokens, valid, key, stop_tokens, stream_id, sampler,
                       max_new_tokens, max_len, chunk_size)  # fmt: skip


def _decode(model, tokens, valid, key, stop_tokens, stream_id, sampler, max_new_tokens, max_len,
            chunk_size):  # fmt: skip
    batch = tokens.shape[0]

    def stream(out, n):  # n tokens written so far
        if chunk_size is not None:
            jax.lax.cond(
                (n - 1) % chunk_size == 0,
                lambda: jax.debug.callback(_emit, stream_id, out, n),
                lambda: None,
            )

    cache = _constrain_cache(init_cache(model.config, batch, max_len))
    x, cache = forward_cached(model, tokens, valid, cache)
    key, sub = jax.random.split(key)
    token = sampler(model.logits(x[:, -1:])[:, 0], sub)
    out = jnp.full((batch, max_new_tokens), NO_TOKEN, jnp.int32).at[:, 0].set(token)
    done = jnp.isin(token, stop_tokens)
    stream(out, 1)

    def keep_going(state):
        n, _, _, _, _, done = state
        return (n < max_new_tokens) & ~jnp.all(done)

    def step(state):
        n, token, cache, key, out, done = state
        x, cache = forward_cached(model, token[:, None], jnp.ones((batch, 1), bool), cache)
        cache = _constrain_cache(cache)
        key, sub = jax.random.split(key)
        new = sampler(model.logits(x)[:, 0], sub)
        # A stopped row keeps decoding in lockstep (fed its last token) but records nothing.
        out = out.at[:, n].set(jnp.where(done, NO_TOKEN, new))
        token = jnp.where(done, token, new)
        done = done | jnp.isin(new, stop_tokens)
        stream(out, n + 1)
        return n + 1, token, cache, key, out, done

    n, *_, out, _ = jax.lax.while_loop(
        keep_going, step, (jnp.int32(1), token, cache, key, out, done)
    )
    return out, n


def generate(
    model: Transformer,
    prompts: Sequence[Sequence[int] | np.ndarray],
    *,
    max_new_tokens: int,
    sampler: Sampler,
    key: PRNGKeyArray,
    stop_tokens: Sequence[int] = (),
    on_tokens: OnTokens | None = None,
    chunk_size: int = 16,
    max_len: int | None = None,
    mesh: Mesh | None = None,
    rules: shard.ShardingRules | None = None,
) -> list[list[int]]:
    """New tokens for each prompt (up to `max_new_tokens`, ending at the first stop token, which
    is included).

    Prompts of different lengths share one batch, left-padded; padding is invisible and each row's
    positions start at 0 at its first real token. `on_tokens(new_tokens_per_row)` is called from
    the device loop with the first token (right after the prefill), then every `chunk_size` tokens,
    and once at the end for the rest. The KV cache holds
    `max_len` tokens (default: longest prompt + max_new_tokens). Bad input is a ValueError before
    anything compiles.

    Sharded generation: give a `mesh` (`shard.mesh(...)`) and `rules`
    (`shard.ShardingRules.preset("tp")`, ...). The weights are placed with `shard.shard_model`,
    the prompts by "batch seq", the KV cache is created and kept in "batch kv_heads kv_seq
    head_dim" (keys) and "batch kv_heads head_dim kv_seq" (values), and the model's activation
    constraints apply; the batch must divide by the mesh axes "batch" maps to.
    """
    if (mesh is None) != (rules is None):
        raise ValueError("sharded generate needs both mesh and rules (or neither)")
    config = model.config
    if isinstance(prompts, np.ndarray | jax.Array) and prompts.ndim == 1:
        raise ValueError("prompts must be a batch (a list of prompts), got one flat array")
    if len(prompts) == 0:
        raise ValueError("prompts is empty; give at least one prompt")
    rows = [np.asarray(p, np.int64).reshape(-1) for p in prompts]
    for i, row in enumerate(rows):
        if row.size == 0:
            raise ValueError(f"prompt {i} is empty; every prompt needs at least one token")
        check_tokens(row, config.vocab_size, f"prompt {i}")
    if max_new_tokens <= 0:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    stops = np.asarray(list(stop_tokens), np.int64).reshape(-1)
    check_tokens(stops, config.vocab_size, "stop_tokens")
    longest = max(row.size for row in rows)
    needed = longest + max_new_tokens
    max_len = needed if max_len is None else max_len
    if needed > max_len:
        raise ValueError(
            f"the longest prompt ({longest} tokens) + max_new_tokens ({max_new_tokens}) = "
            f"{needed} exceeds the KV cache max_len={max_len}"
        )
    if config.position == "learned" and max_len > config.max_seq_len:
        raise ValueError(
            f"the longest prompt ({longest} tokens) + max_new_tokens ({max_new_tokens}) = "
            f"{max_len} exceeds Config.max_seq_len={config.max_seq_len}, the size of the learned "
            "position table"
        )
    tokens = np.zeros((len(rows), longest), np.int32)
    valid = np.zeros((len(rows), longest), bool)
    for i, row in enumerate(rows):
        tokens[i, longest - row.size :] = row
        valid[i, longest - row.size :] = True

    # Per-layer weight arrays: one copy per call, much faster decode steps (infer/step.py).
    model = model.unstack_layers()
    tokens, valid = jnp.asarray(tokens), jnp.asarray(valid)
    sharding = None
    if mesh is not None:
        model = shard.shard_model(model, rules, mesh)
        placement = shard.named_sharding("batch seq", rules, mesh)
        check_divisible("generate: the batch of prompts", tokens.shape, ("batch", "seq"),
                        placement.spec, dict(mesh.shape))  # fmt: skip
        tokens, valid = jax.device_put(tokens, placement), jax.device_put(valid, placement)
        sharding = (rules, mesh)
    stream_id = next(_stream_ids)
    if on_tokens is not None:
        _STREAMS[stream_id] = _Stream(on_tokens)
    try:
        out, n = _generate(
            model,
            tokens,
            valid,
            key,
            jnp.asarray(stops, jnp.int32),
            jnp.int32(stream_id),
            sampler,
            max_new_tokens,
            max_len,
            chunk_size if on_tokens is not None else None,
            sharding,
        )
        out, n = np.asarray(out), int(n)
        if on_tokens is not None:
            jax.effects_barrier()
            _STREAMS[stream_id].emit(out, n)
    finally:
        _STREAMS.pop(stream_id, None)
    return [[int(t) for t in row[:n] if t != NO_TOKEN] for row in out]
