"""Verification of proposed tokens: the target's logits at a row's last token and its `k` draft
tokens (one forward over a group of `k + 1` tokens) decide how many drafts stay, and give one
more token from the target itself, so every verification emits between 1 and `k + 1` tokens.

- Greedy rows (temperature 0): a draft stays while it equals the target's argmax at its position;
  the emitted tokens are then the target's argmax at positions `0..a` (`a` drafts accepted), the
  tokens non-speculative greedy decoding gives, exactly.
- Sampling rows: the rejection rule of speculative sampling (Leviathan et al. 2023, "Fast
  Inference from Transformers via Speculative Decoding", Algorithm 1; Chen et al. 2023): draft
  `d_j`, drawn from the proposer's distribution `q_j`, stays with probability
  `min(1, p_j(d_j) / q_j(d_j))` (`p_j` the target's distribution under the row's sampler:
  temperature, then top-k / top-p / min-p); at the first rejection the token is drawn from
  `norm(max(p_j - q_j, 0))`; when all `k` stay, one more is drawn from `p_k`. The emitted
  tokens are distributed exactly as the target's own samples. A deterministic proposer (prompt
  lookup) has `q_j = one-hot(d_j)`: the draft stays with probability `p_j(d_j)`.
"""

from collections.abc import Callable

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int, PRNGKeyArray

from infer.sampling import SamplingParams, filter_logits

Residual = Callable[[Float[Array, "... vocab"], Float[Array, "... vocab"]], Array]


def residual(
    p: Float[Array, "*batch vocab"], q: Float[Array, "*batch vocab"]
) -> Float[Array, "*batch vocab"]:
    """What a rejection is drawn from: `max(p - q, 0)` (unnormalised; where it is all zero,
    p == q and a rejection has probability 0, so `p` stands in)."""
    rest = jnp.maximum(p - q, 0.0)
    return jnp.where(jnp.sum(rest, axis=-1, keepdims=True) > 0, rest, p)


def target_probs(
    logits: Float[Array, "rows group vocab"], params: SamplingParams
) -> Float[Array, "rows group vocab"]:
    """Each position's distribution under its row's sampler (temperature, then the filters);
    greedy rows get temperature 1 (their probabilities are not used)."""
    rows, group, vocab = logits.shape
    temperature = jnp.where(params.temperature == 0, 1.0, params.temperature)
    tempered = logits.astype(jnp.float32) / temperature[:, None, None]
    per_position = jax.tree.map(lambda x: jnp.repeat(x, group), params)
    filtered = filter_logits(tempered.reshape(rows * group, vocab), per_position)
    return jax.nn.softmax(filtered, axis=-1).reshape(rows, group, vocab)


def _leading(accept: Array) -> Int[Array, " rows"]:
    """How many leading entries of each row are True."""
    return jnp.sum(jnp.cumprod(accept.astype(jnp.int32), axis=1), axis=1)


def accept_sampled(
    p: Float[Array, "rows group vocab"],
    drafts: Int[Array, "rows drafts"],
    k: Int[Array, " rows"],
    q: Float[Array, "rows drafts vocab"] | None,
    key: PRNGKeyArray,
    *,
    rejected: Residual = residual,
) -> tuple[Int[Array, "rows group"], Int[Array, " rows"]]:
    """The rejection rule (module docstring) on the target's distributions `p` at positions
    `0..K` and the proposer's `q` at the drafts (None: deterministic drafts, one-hot); `k` real
    drafts per row. `rejected(p, q)` is what a rejection is drawn from (`residual`; a test swaps
    in a wrong rule to see the statistical test fail). Returns the tokens `[rows, K + 1]`, of
    which the first `n` `[rows]` are emitted."""
    rows, drafts_n = drafts.shape
    uniform_key, draw_key = jax.random.split(key)
    p_draft = jnp.take_along_axis(p[:, :drafts_n], drafts[..., None], axis=-1)[..., 0]
    if q is None:
        q = jax.nn.one_hot(drafts, p.shape[-1], dtype=p.dtype)
    q_draft = jnp.take_along_axis(q, drafts[..., None], axis=-1)[..., 0]
    r = jax.random.uniform(uniform_key, (rows, drafts_n))
    real = jnp.arange(drafts_n)[None, :] < k[:, None]
    a = _leading(real & (r * q_draft < p_draft))
    p_at = jnp.take_along_axis(p, a[:, None, None], axis=1)[:, 0]
    q_padded = jnp.concatenate([q, jnp.zeros_like(q[:, :1])], axis=1)
    q_at = jnp.take_along_axis(q_padded, a[:, None, None], axis=1)[:, 0]
    dist = jnp.where((a < k)[:, None], rejected(p_at, q_at), p_at)
    extra = jax.random.categorical(draw_key, jnp.log(dist), axis=-1).astype(jnp.int32)
    padded = jnp.concatenate([drafts, jnp.zeros_like(drafts[:, :1])], axis=1)
    tokens = jnp.where(jnp.arange(drafts_n + 1)[None, :] == a[:, None], extra[:, None], padded)
    return tokens, a + 1


def verify(
    logits: Float[Array, "rows group vocab"],
    drafts: Int[Array, "rows drafts"],
    k: Int[Array, " rows"],
    q: Float[Array, "rows drafts vocab"] | None,
    params: SamplingParams,
    key: PRNGKeyArray,
) -> tuple[Int[Array, "rows group"], Int[Array, " rows"]]:
    """Each row's emitted tokens `[rows, K + 1]` and their number `n` `[rows]` (1 to `k + 1`)
    from the target's `logits` at the row's last token and its drafts, each row by its own
    sampler: greedy rows by argmax agreement, the others by the rejection rule."""
    greedy = params.temperature == 0
    argmax = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    real = jnp.arange(drafts.shape[1])[None, :] < k[:, None]
    greedy_n = _leading(real & (drafts == argmax[:, :-1])) + 1

    def sampled():
        return accept_sampled(target_probs(logits, params), drafts, k, q, key)

    def none_sampled():
        return argmax, greedy_n

    tokens, n = jax.lax.cond(jnp.all(greedy), none_sampled, sampled)
    return (
        jnp.where(greedy[:, None], argmax, tokens),
        jnp.where(greedy, greedy_n, n),
    )
