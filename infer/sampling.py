"""Samplers: next-token logits `[batch, vocab]` and a key -> token ids `[batch]`.

Greedy; temperature (Ackley et al. 1985's Boltzmann sampling); top-k (Fan et al. 2018); top-p /
nucleus (Holtzman et al. 2020); min-p (Nguyen et al. 2024). Temperature is applied first, then
the filter (as HF transformers does). Each sampler is a small frozen module, validated when built,
and a pure function of (logits, key): the same key gives the same tokens.
"""

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int, PRNGKeyArray

_NEG_INF = -jnp.inf


def _tempered(
    logits: Float[Array, "batch vocab"], temperature: float
) -> Float[Array, "batch vocab"]:
    return logits.astype(jnp.float32) / temperature


def _draw(logits: Float[Array, "batch vocab"], key: PRNGKeyArray) -> Int[Array, " batch"]:
    return jax.random.categorical(key, logits, axis=-1).astype(jnp.int32)


def _argmax(logits: Float[Array, "batch vocab"]) -> Int[Array, " batch"]:
    return jnp.argmax(logits, axis=-1).astype(jnp.int32)


class Sampler(eqx.Module):
    """Base of every sampler: `temperature` (0 = greedy) then `filter` the tempered logits.
    (Equinox runs every class's `__check_init__`, so this check covers the subclasses too.)"""

    temperature: float = eqx.field(static=True, default=1.0)

    def __check_init__(self):
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0 (0 means greedy), got {self.temperature}")

    def filter(self, logits: Float[Array, "batch vocab"]) -> Float[Array, "batch vocab"]:
        """Tempered logits with the excluded tokens set to -inf (none here)."""
        return logits

    def __call__(
        self, logits: Float[Array, "batch vocab"], key: PRNGKeyArray
    ) -> Int[Array, " batch"]:
        if self.temperature == 0:
            return _argmax(logits)
        return _draw(self.filter(_tempered(logits, self.temperature)), key)


class Greedy(Sampler):
    """The most likely token, always (temperature 0)."""

    temperature: float = eqx.field(static=True, default=0.0)

    def __check_init__(self):
        if self.temperature != 0:
            raise ValueError(f"Greedy has temperature 0, got {self.temperature}")


class Temperature(Sampler):
    """Sample from softmax(logits / temperature) over the whole vocabulary."""


class TopK(Sampler):
    """Sample among the `k` most likely tokens only."""

    k: int = eqx.field(static=True, default=50)

    def __check_init__(self):
        if self.k < 1:
            raise ValueError(f"TopK.k must be >= 1, got {self.k}")

    def filter(self, logits: Float[Array, "batch vocab"]) -> Float[Array, "batch vocab"]:
        kth = jax.lax.top_k(logits, min(self.k, logits.shape[-1]))[0][:, -1:]
        return jnp.where(logits >= kth, logits, _NEG_INF)


class TopP(Sampler):
    """Nucleus sampling: the smallest set of most likely tokens whose probability reaches `p`."""

    p: float = eqx.field(static=True, default=0.9)

    def __check_init__(self):
        if not 0 < self.p <= 1:
            raise ValueError(f"TopP.p (top-p) must be in (0, 1], got {self.p}")

    def filter(self, logits: Float[Array, "batch vocab"]) -> Float[Array, "batch vocab"]:
        order = jnp.argsort(-logits, axis=-1)
        sorted_probs = jax.nn.softmax(jnp.take_along_axis(logits, order, axis=-1), axis=-1)
        # Keep a token while the mass before it is still short of p (so the top one always stays).
        mass_before = jnp.cumsum(sorted_probs, axis=-1) - sorted_probs
        keep_sorted = mass_before < self.p
        keep = (
            jnp.zeros_like(keep_sorted)
            .at[jnp.arange(logits.shape[0])[:, None], order]
            .set(keep_sorted)
        )
        return jnp.where(keep, logits, _NEG_INF)


class MinP(Sampler):
    """Keep tokens whose probability is at least `p` times the most likely token's."""

    p: float = eqx.field(static=True, default=0.05)

    def __check_init__(self):
        if not 0 <= self.p <= 1:
            raise ValueError(f"MinP.p (min-p) must be in [0, 1], got {self.p}")

    def filter(self, logits: Float[Array, "batch vocab"]) -> Float[Array, "batch vocab"]:
        # p_i >= p * p_max  <=>  logit_i >= logit_max + log(p)
        threshold = jnp.max(logits, axis=-1, keepdims=True) + jnp.log(self.p)
        return jnp.where(logits >= threshold, logits, _NEG_INF)
