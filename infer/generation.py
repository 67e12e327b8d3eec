"""`generate`: ragged prompts in one left-padded batch, one prefill, then the whole decode loop on
device (`lax.while_loop`), stopping early once every row has emitted a stop token, with optional
host streaming of the new tokens in chunks. Under a sharded `Placement` the prompts and the KV
cache are placed by their logical axes and every activation constraint of the model applies
(shard/); the weights are used where they already are, never copied."""

import itertools
from collections.abc import Callable, Sequence

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, ArrayLike, Bool, Int, PRNGKeyArray

from infer.sampling import Sampler
from infer.step import check_prompts, check_tokens
from shard import Placement
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
    placement: Placement,
) -> tuple[Int[Array, "batch new"], Int[Array, ""]]:
    # Inside the trace, so every `constrain` of the model sees the placement's rules.
    with placement.context():
        return _decode(model, tokens, valid, key, stop_tokens, stream_id, sampler,
                       max_new_tokens, max_len, chunk_size, placement)  # fmt: skip


def _decode(model, tokens, valid, key, stop_tokens, stream_id, sampler, max_new_tokens, max_len,
            chunk_size, placement):  # fmt: skip
    batch = tokens.shape[0]

    def stream(out, n):  # n tokens written so far
        if chunk_size is not None:
            jax.lax.cond(
                (n - 1) % chunk_size == 0,
                lambda: jax.debug.callback(_emit, stream_id, out, n),
                lambda: None,
            )

    def step(token_block, segment_ids, cache):
        out = model.forward(
            token_block,
            segment_ids=segment_ids,
            cache=cache,
            logits_at=jnp.full((batch, 1), token_block.shape[1] - 1),
        )
        return out.logits[:, 0], placement.constrain_arrays(out.cache)

    cache = placement.constrain_arrays(model.init_cache(batch, max_len))
    logits, cache = step(tokens, valid.astype(jnp.int32), cache)
    key, sub = jax.random.split(key)
    token = sampler(logits, sub)
    out = jnp.full((batch, max_new_tokens), NO_TOKEN, jnp.int32).at[:, 0].set(token)
    done = jnp.isin(token, stop_tokens)
    stream(out, 1)

    def keep_going(state):
        n, _, _, _, _, done = state
        return (n < max_new_tokens) & ~jnp.all(done)

    def decode(state):
        n, token, cache, key, out, done = state
        logits, cache = step(token[:, None], jnp.ones((batch, 1), jnp.int32), cache)
        key, sub = jax.random.split(key)
        new = sampler(logits, sub)
        # A stopped row keeps decoding in lockstep (fed its last token) but records nothing.
        out = out.at[:, n].set(jnp.where(done, NO_TOKEN, new))
        token = jnp.where(done, token, new)
        done = done | jnp.isin(new, stop_tokens)
        stream(out, n + 1)
        return n + 1, token, cache, key, out, done

    n, *_, out, _ = jax.lax.while_loop(
        keep_going, decode, (jnp.int32(1), token, cache, key, out, done)
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
    placement: Placement | None = None,
) -> list[list[int]]:
    """New tokens for each prompt (up to `max_new_tokens`, ending at the first stop token, which
    is included).

    `prompts` is a list of prompts (each a list or 1-D array of token ids) or a 2-D array.
    Prompts of different lengths share one batch, left-padded; padding is invisible and each row's
    positions start at 0 at its first real token. `on_tokens(new_tokens_per_row)` is called from
    the device loop with the first token (right after the prefill), then every `chunk_size` tokens,
    and once at the end for the rest. The KV cache holds `max_len` tokens (default: longest prompt
    + max_new_tokens). Bad input is a ValueError before anything compiles.

    Decode runs over the model's layer storage as it is: `model.unstacked()` (once, kept) runs
    faster per token where slicing stacked weights copies them (bench/decode_layout.py); the
    stacked model decodes through `lax.scan` without any copy of the weights.

    Sharded generation: give the `placement` the model was created or loaded in
    (`shard.Placement(mesh, rules)`). The prompts are placed by "batch seq", the KV cache by its
    logical axes (layers/kv_cache.py), and the model's activation constraints apply; the batch
    must divide by the mesh axes "batch" maps to.
    """
    placement = placement or Placement()
    config = model.config
    rows = check_prompts(prompts, config.vocab_size)
    if max_new_tokens <= 0:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    stops = np.asarray(list(stop_tokens)).reshape(-1)
    check_tokens(stops if stops.size else stops.astype(np.int64), config.vocab_size, "stop_tokens")
    longest = max(row.size for row in rows)
    needed = longest + max_new_tokens
    max_len = needed if max_len is None else max_len
    if needed > max_len:
        raise ValueError(
            f"the longest prompt ({longest} tokens) + max_new_tokens ({max_new_tokens}) = "
            f"{needed} exceeds the KV cache max_len={max_len}"
        )
    config.check_length(max_len, "the longest prompt + max_new_tokens (KV cache max_len)")
    tokens = np.zeros((len(rows), longest), np.int32)
    valid = np.zeros((len(rows), longest), bool)
    for i, row in enumerate(rows):
        tokens[i, longest - row.size :] = row
        valid[i, longest - row.size :] = True
    if placement.sharded:
        spec = placement.batch_sharding().spec
        check_divisible("generate: the batch of prompts", tokens.shape, ("batch", "seq"), spec,
                        dict(placement.mesh.shape))  # fmt: skip
    tokens, valid = placement.batch((tokens, valid))
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
            placement,
        )
        out, n = np.asarray(out), int(n)
        if on_tokens is not None:
            jax.effects_barrier()
            _STREAMS[stream_id].emit(out, n)
    finally:
        _STREAMS.pop(stream_id, None)
    return [[int(t) for t in row[:n] if t != NO_TOKEN] for row in out]
