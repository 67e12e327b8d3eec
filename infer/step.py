"""Prefill (a whole prompt block into the cache) and one decode step: the model's own forward
with a paged KV cache (`model.init_cache`, `Transformer.forward(..., cache=)`), jitted with the
cache donated, so the cache is updated in place, never copied. infer/ only orchestrates; the model
computes. Also the checks of token ids and prompts that every entry point of infer/ shares."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, Int

from layers.paged_cache import PagedKVCache
from zoo.transformer import Transformer


@functools.partial(jax.jit, donate_argnames="cache")
def _prefill(model, tokens, valid, cache):
    out = model.forward(tokens, valid=valid, cache=cache)
    return out.logits, out.cache


@functools.partial(jax.jit, donate_argnames="cache")
def _decode_step(model, token, cache):
    out = model.forward(token[:, None], cache=cache)
    return out.logits[:, 0], out.cache


def check_tokens(tokens: np.ndarray, vocab_size: int, what: str) -> None:
    """Token ids must be integers that index the vocabulary (an out-of-range id would silently
    read garbage, a float would be silently truncated)."""
    if tokens.size and not np.issubdtype(tokens.dtype, np.integer):
        raise ValueError(f"{what} must hold integer token ids, got dtype {tokens.dtype}")
    if tokens.size and (tokens.min() < 0 or tokens.max() >= vocab_size):
        bad = tokens[(tokens < 0) | (tokens >= vocab_size)][0]
        raise ValueError(
            f"{what} holds token id {int(bad)} outside the vocabulary [0, {vocab_size})"
        )


def check_prompts(prompts, vocab_size: int) -> list[np.ndarray]:
    """A batch of prompts as 1-D int arrays: a list of prompts (lists or 1-D arrays of token
    ids) or a 2-D array. A flat list of ids, a 1-D or 3-D array, non-integer ids, an empty batch
    or an empty prompt are errors that say what to pass instead."""
    if isinstance(prompts, np.ndarray | jax.Array):
        if prompts.ndim != 2:
            raise ValueError(
                f"prompts as an array must be 2-D [batch, seq], got shape {prompts.shape}; for one "
                "prompt pass [ids]"
            )
        prompts = list(np.asarray(prompts))
    if isinstance(prompts, str) or not hasattr(prompts, "__len__"):
        raise ValueError(f"prompts must be a list of prompts (lists of token ids), got {prompts!r}")
    if len(prompts) == 0:
        raise ValueError("prompts is empty; give at least one prompt")
    rows = []
    for i, prompt in enumerate(prompts):
        if isinstance(prompt, int | np.integer | float | np.floating):
            raise ValueError(
                "prompts must be a list of prompts, each a list of token ids; got a flat list of "
                f"ids (item {i} is {prompt!r}): for one prompt pass [[1, 2, 3]]"
            )
        row = np.asarray(prompt)
        if row.ndim != 1:
            raise ValueError(f"prompt {i} must be a 1-D list of token ids, got shape {row.shape}")
        if row.size == 0:
            raise ValueError(f"prompt {i} is empty; every prompt needs at least one token")
        check_tokens(row, vocab_size, f"prompt {i}")
        rows.append(row.astype(np.int64))
    return rows


def _check_room(cache: PagedKVCache, n: int) -> None:
    held = int(np.max(np.asarray(cache.lengths)))
    if held + n > cache.max_len:
        raise ValueError(
            f"{n} new token(s) after {held} cached ones do not fit the KV cache "
            f"(max_len={cache.max_len}); make a larger cache with model.init_cache"
        )


def prefill(
    model: Transformer,
    tokens: Int[Array, "batch seq"],
    cache: PagedKVCache,
    *,
    lengths: Int[Array, " batch"] | None = None,
) -> tuple[Float[Array, "batch seq vocab"], PagedKVCache]:
    """Run a prompt block through the model, filling the cache; logits for every position.

    Rows shorter than `seq` are left-padded: `lengths[b]` real tokens sit at the end of row b
    (default: every token is real). The padding's logits are meaningless.
    """
    host = np.asarray(tokens)
    batch = cache.page_table.shape[0]
    if host.ndim != 2 or host.shape[0] != batch:
        raise ValueError(f"prefill tokens must be [batch={batch}, seq], got shape {host.shape}")
    if host.shape[1] == 0:
        raise ValueError("prefill got an empty prompt (seq = 0); give at least one token")
    check_tokens(host, model.config.vocab_size, "prefill tokens")
    _check_room(cache, host.shape[1])
    seq = host.shape[1]
    lengths = np.full(batch, seq) if lengths is None else np.asarray(lengths)
    if lengths.min() < 1 or lengths.max() > seq:
        raise ValueError(f"prefill lengths must be in [1, seq={seq}], got {lengths.tolist()}")
    valid = np.arange(seq)[None, :] >= (seq - lengths)[:, None]
    return _prefill(model, jnp.asarray(host, jnp.int32), jnp.asarray(valid), cache)


def decode_step(
    model: Transformer, token: Int[Array, " batch"], cache: PagedKVCache
) -> tuple[Float[Array, "batch vocab"], PagedKVCache]:
    """One token per row through the model at each row's next position; next-token logits.

    Checks the token ids and the cache's room on the host (one sync); the serving engine runs
    its own step with the checks done at submit instead."""
    host = np.asarray(token)
    batch = cache.page_table.shape[0]
    if host.shape != (batch,):
        raise ValueError(f"decode_step token must be [batch={batch}], got {host.shape}")
    check_tokens(host, model.config.vocab_size, "decode_step token")
    _check_room(cache, 1)
    return _decode_step(model, jnp.asarray(host, jnp.int32), cache)
