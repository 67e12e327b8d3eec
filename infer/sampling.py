"""Samplers: next-token logits `[batch, vocab]` and a key -> token ids `[batch]`.

Greedy; temperature (Ackley et al. 1985's Boltzmann sampling); top-k (Fan et al. 2018); top-p /
nucleus (Holtzman et al. 2020); min-p (Nguyen et al. 2024). Temperature is applied first, then
the filters (as HF transformers does). Sampling is a pure function of (logits, parameters, key):
the same key gives the same tokens.

Every parameter is data, never static: `SamplingParams` holds one value per row
(`temperature` 0 = greedy, `top_k` 0 = off, `top_p` 1 = off, `min_p` 0 = off), so one compiled
`sample` serves any mix of requests and a new setting never recompiles. The user-facing
samplers (`Greedy()`, `Temperature(t)`, `TopK(k)`, `TopP(p)`, `MinP(p)`) are small modules whose
fields are arrays, validated when built; `stack_samplers` turns one per request into the rows of
a `SamplingParams`.

No sort of the vocabulary: each filter keeps the tokens at or above a threshold logit, and the
top-k and top-p thresholds are found exactly by bisection over the float32 values in their order
(`_search_threshold`: 32 masked sums over the logits), each only when some row uses that filter.
"""

import abc
import typing
from collections.abc import Sequence

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, ArrayLike, Float, Int, Key, PRNGKeyArray


def _is_traced(*xs) -> bool:
    return any(isinstance(x, jax.core.Tracer) for x in xs)


def _check_temperature(value: ArrayLike, name: str) -> None:
    if not _is_traced(value):
        t = np.asarray(value, np.float64)
        bad = ~np.isfinite(t) | (t < 0)
        if bad.any():
            raise ValueError(
                f"{name} must be >= 0 and finite (0 means greedy), got {t[bad].flat[0]}"
            )


def _check_probability(value: ArrayLike, name: str, *, zero_ok: bool) -> None:
    if not _is_traced(value):
        p = np.asarray(value, np.float64)
        bad = ~((p >= 0 if zero_ok else p > 0) & (p <= 1))  # NaN fails both
        if bad.any():
            interval = "[0, 1]" if zero_ok else "(0, 1]"
            raise ValueError(f"{name} must be in {interval}, got {p[bad].flat[0]}")


def _check_top_k(value: ArrayLike, name: str, *, zero_ok: bool) -> None:
    if not _is_traced(value):
        k = np.asarray(value)
        if k.dtype == bool or not (
            np.issubdtype(k.dtype, np.integer)
            or (np.issubdtype(k.dtype, np.floating) and np.all(k == np.round(k)))
        ):
            raise ValueError(f"{name} must be an integer, got {k.flat[0] if k.size else k}")
        low = 0 if zero_ok else 1
        bad = (k < low) | (k > np.iinfo(np.int32).max)
        if bad.any():
            raise ValueError(f"{name} must be >= {low} and < 2**31, got {k[bad].flat[0]}")


def _host(value: ArrayLike, dtype) -> np.ndarray | Array:
    """`value` as a `dtype` numpy array (unless traced): a sampler's settings stay on the host,
    where the serving engine reads them while a step runs (an array on the device is only
    readable, and a cast on it only done, once the device has finished what it was running)."""
    return value if _is_traced(value) else np.asarray(value, dtype)


def _temperature(value: ArrayLike, name: str = "temperature") -> np.ndarray | Array:
    _check_temperature(value, name)
    return _host(value, np.float32)


def _probability(value: ArrayLike, name: str, *, zero_ok: bool) -> np.ndarray | Array:
    _check_probability(value, name, zero_ok=zero_ok)
    return _host(value, np.float32)


def _top_k(value: ArrayLike, name: str, *, zero_ok: bool) -> np.ndarray | Array:
    _check_top_k(value, name, zero_ok=zero_ok)
    return _host(value, np.int32)


class SamplingParams(eqx.Module):
    """Per-row sampler settings, all runtime data: `temperature` (0 = greedy), `top_k` (0 = off),
    `top_p` (1 = off), `min_p` (0 = off). Filters compose as HF's do: temperature, then top-k,
    then top-p over the top-k survivors (renormalised), then min-p. Values are checked when
    built from concrete arrays (a ValueError names the field)."""

    temperature: Float[Array, " batch"]
    top_k: Int[Array, " batch"]
    top_p: Float[Array, " batch"]
    min_p: Float[Array, " batch"]

    def __init__(
        self,
        *,
        temperature: Float[ArrayLike, " batch"],
        top_k: Int[ArrayLike, " batch"],
        top_p: Float[ArrayLike, " batch"],
        min_p: Float[ArrayLike, " batch"],
    ):
        self.temperature = jnp.asarray(_temperature(temperature, "SamplingParams.temperature"))
        self.top_k = jnp.asarray(_top_k(top_k, "SamplingParams.top_k", zero_ok=True))
        self.top_p = jnp.asarray(_probability(top_p, "SamplingParams.top_p", zero_ok=False))
        self.min_p = jnp.asarray(_probability(min_p, "SamplingParams.min_p", zero_ok=True))
        shapes = {x.shape for x in (self.temperature, self.top_k, self.top_p, self.min_p)}
        if len(shapes) != 1 or len(next(iter(shapes))) != 1:
            raise ValueError(
                f"SamplingParams fields must be 1-D arrays of one length (one per row), got "
                f"shapes {sorted(shapes)}"
            )

    @property
    def batch(self) -> int:
        return self.temperature.shape[0]

    def broadcast(self, batch: int) -> "SamplingParams":
        """These settings for `batch` rows: one row is repeated, `batch` rows kept as they are."""
        if self.batch not in (1, batch):
            raise ValueError(f"SamplingParams has {self.batch} rows, cannot serve {batch}")
        return jax.tree.map(lambda x: jnp.broadcast_to(x, (batch,)), self)


class Settings(typing.NamedTuple):
    """One sampler's settings, each a number or a scalar array (`SamplingParams`' fields for
    one row)."""

    temperature: Float[ArrayLike, ""]
    top_k: Int[ArrayLike, ""] = 0
    top_p: Float[ArrayLike, ""] = 1.0
    min_p: Float[ArrayLike, ""] = 0.0


def check_settings(settings: Settings, name: str) -> None:
    """A ValueError naming `name`'s field when a setting is out of range, found on the host
    (no device work: the serving engine checks a request while a step runs)."""
    for field, value in settings._asdict().items():
        if np.ndim(value) != 0:
            raise ValueError(f"{name}.{field} must be one number, got shape {np.shape(value)}")
    _check_temperature(settings.temperature, f"{name}.temperature")
    _check_top_k(settings.top_k, f"{name}.top_k", zero_ok=True)
    _check_probability(settings.top_p, f"{name}.top_p", zero_ok=False)
    _check_probability(settings.min_p, f"{name}.min_p", zero_ok=True)


class Sampler(eqx.Module):
    """One request's sampler: its settings as a row of `SamplingParams`."""

    @abc.abstractmethod
    def settings(self) -> Settings:
        """This sampler's settings: its fields, host numbers unless traced (`_host`)."""

    def params(self) -> SamplingParams:
        """This sampler's settings as one row."""
        settings = self.settings()
        reshape = jnp.reshape if _is_traced(*settings) else np.reshape
        return SamplingParams(**{n: reshape(v, (1,)) for n, v in settings._asdict().items()})

    def filter(self, logits: Float[Array, "batch vocab"]) -> Float[Array, "batch vocab"]:
        """The (already tempered) logits with the tokens this sampler excludes set to -inf."""
        return filter_logits(logits, self.params())

    def __call__(
        self, logits: Float[Array, "batch vocab"], key: PRNGKeyArray
    ) -> Int[Array, " batch"]:
        return sample(logits, self.params(), key)


class Greedy(Sampler):
    """The most likely token, always (temperature 0)."""

    def settings(self) -> Settings:
        return Settings(0.0)


class Temperature(Sampler):
    """Sample from softmax(logits / temperature) over the whole vocabulary (0 = greedy)."""

    temperature: Float[ArrayLike, ""]

    def __init__(self, temperature: float = 1.0):
        self.temperature = _temperature(temperature)

    def settings(self) -> Settings:
        return Settings(self.temperature)


class TopK(Sampler):
    """Sample among the `k` most likely tokens only (and any tied with the k-th)."""

    k: Int[ArrayLike, ""]
    temperature: Float[ArrayLike, ""]

    def __init__(self, k: int = 50, temperature: float = 1.0):
        self.k = _top_k(k, "TopK.k", zero_ok=False)
        self.temperature = _temperature(temperature)

    def settings(self) -> Settings:
        return Settings(self.temperature, top_k=self.k)


class TopP(Sampler):
    """Nucleus sampling: the smallest set of most likely tokens whose probability reaches `p`."""

    p: Float[ArrayLike, ""]
    temperature: Float[ArrayLike, ""]

    def __init__(self, p: float = 0.9, temperature: float = 1.0):
        self.p = _probability(p, "TopP.p (top-p)", zero_ok=False)
        self.temperature = _temperature(temperature)

    def settings(self) -> Settings:
        return Settings(self.temperature, top_p=self.p)


class MinP(Sampler):
    """Keep tokens whose probability is at least `p` times the most likely token's."""

    p: Float[ArrayLike, ""]
    temperature: Float[ArrayLike, ""]

    def __init__(self, p: float = 0.05, temperature: float = 1.0):
        self.p = _probability(p, "MinP.p (min-p)", zero_ok=True)
        self.temperature = _temperature(temperature)

    def settings(self) -> Settings:
        return Settings(self.temperature, min_p=self.p)


def stack_samplers(samplers: Sequence[Sampler]) -> SamplingParams:
    """The rows of a `SamplingParams`, one per request's sampler, in order."""
    if not samplers:
        raise ValueError("stack_samplers needs at least one sampler")
    return jax.tree.map(lambda *rows: jnp.concatenate(rows), *(s.params() for s in samplers))


def _order_key(x: Float[Array, "..."]) -> Array:
    """float32 -> uint32 with the same order (-inf < ... < -0.0 < +0.0 < ... < +inf)."""
    bits = jax.lax.bitcast_convert_type(x, jnp.uint32)
    return jnp.where(bits >> 31 == 1, ~bits, bits | jnp.uint32(0x80000000))


def _from_order_key(key: Array) -> Float[Array, "..."]:
    bits = jnp.where(key >> 31 == 1, key & jnp.uint32(0x7FFFFFFF), ~key)
    return jax.lax.bitcast_convert_type(bits, jnp.float32)


def _search_threshold(
    logits: Float[Array, "batch vocab"],
    weights: Float[Array, "batch vocab"],
    limit: Float[Array, " batch"],
) -> Float[Array, " batch"]:
    """Per row, the smallest float32 t (above -inf, at most the row's max) with
    sum(weights[logits > t]) < limit: keeping `logits >= t` keeps exactly the tokens whose
    strictly-larger tokens weigh less than `limit`.

    The sum shrinks as t grows, so t is found by bisection over the order keys of float32: 32
    passes, each one masked sum over the row, pin down one float32 value. Float rounding is
    monotone, so the computed sums keep that order and the search is exact. On a GPU the passes
    are unrolled (a rolled loop would cost a host round trip per pass for its condition); on a
    CPU they are a loop, which compiles in half the time and runs as fast.
    """
    lo = jnp.broadcast_to(_order_key(jnp.float32(-jnp.inf)), limit.shape)
    hi = _order_key(jnp.max(logits, axis=-1))  # the sum over nothing, 0, is < limit (limit > 0)

    def halve(_, bounds):  # the width hi - lo < 2^32 at least halves each pass
        lo, hi = bounds
        mid = lo + (hi - lo) // 2
        above = jnp.sum(jnp.where(logits > _from_order_key(mid)[:, None], weights, 0.0), axis=-1)
        found = above < limit
        return jnp.where(found, lo, mid), jnp.where(found, mid, hi)

    unroll = jax.default_backend() != "cpu"
    _, hi = jax.lax.fori_loop(0, 32, halve, (lo, hi), unroll=unroll)
    return _from_order_key(hi)


@jax.jit
def filter_logits(
    logits: Float[Array, "batch vocab"], params: SamplingParams
) -> Float[Array, "batch vocab"]:
    """Tempered logits with every token that a row's top-k, top-p or min-p excludes set to -inf.

    top-k keeps the tokens >= the k-th largest logit; top-p keeps a token iff the probability of
    the tokens strictly more likely than it is < p (so the most likely token always stays, and
    tokens tied with a kept one are kept: the set does not depend on vocabulary order); min-p
    keeps p_i >= min_p * p_max. Each is a threshold on the logits, found without sorting.
    `params` has one row per logits row, or one row for all.
    """
    params = params.broadcast(logits.shape[0])
    logits = logits.astype(jnp.float32)
    top = jnp.max(logits, axis=-1)
    off = jnp.full(top.shape, -jnp.inf)
    use_k, use_p = params.top_k > 0, params.top_p < 1

    def search(phase, found):
        """Phase 0 finds the top-k threshold, phase 1 the top-p one over the top-k survivors
        (unnormalised probabilities against p * their total); rows that do not use a phase's
        filter get -inf from it."""
        kth, nucleus = found
        mass = jnp.where(logits >= kth[:, None], jnp.exp(logits - top[:, None]), 0.0)
        k_phase = phase == 0
        weights = jnp.where(k_phase, 1.0, mass)
        limit = jnp.where(
            k_phase,
            jnp.maximum(params.top_k, 1).astype(jnp.float32),
            params.top_p * jnp.sum(mass, axis=-1),
        )
        found = jnp.where(
            k_phase & use_k | ~k_phase & use_p, _search_threshold(logits, weights, limit), off
        )
        return jnp.where(k_phase, found, kth), jnp.where(k_phase, nucleus, found)

    # Both searches are one loop over phases, so XLA compiles the search once (a loop per
    # search, each under its own cond, cost twice the kernels to compile). A phase runs only
    # when some row uses its filter: greedy and plain temperature batches run none.
    first = jnp.where(jnp.any(use_k), 0, 1)
    last = jnp.where(jnp.any(use_p), 2, 1)
    kth, nucleus = jax.lax.fori_loop(first, last, search, (off, off))
    # p_i >= min_p * p_max  <=>  logit_i >= logit_max + log(min_p)
    floor = top + jnp.log(params.min_p)
    threshold = jnp.maximum(jnp.maximum(kth, nucleus), floor)
    return jnp.where(logits >= threshold[:, None], logits, -jnp.inf)


@jax.jit
def sample(
    logits: Float[Array, "batch vocab"],
    params: SamplingParams,
    key: PRNGKeyArray | Key[Array, " batch"],
) -> Int[Array, " batch"]:
    """One token per row, each row with its own settings: argmax where temperature is 0, else a
    draw from softmax of the filtered logits / temperature (Gumbel-max through
    `jax.random.categorical`: exact for every token, tail included, but one random number per
    logit). An all-greedy batch skips the filters and the draw. `params` has one row per logits
    row, or one row for all; `key` is one key, or one per row (`[batch]`: each row's draw then
    depends only on its own key, not on the batch around it)."""
    params = params.broadcast(logits.shape[0])
    greedy = params.temperature == 0

    def draw():
        tempered = logits.astype(jnp.float32) / jnp.where(greedy, 1.0, params.temperature)[:, None]
        filtered = filter_logits(tempered, params)
        if key.ndim == 0:
            drawn = jax.random.categorical(key, filtered, axis=-1)
        else:  # what categorical does (argmax of logits + Gumbel noise), with each row's key
            noise = jax.vmap(lambda k: jax.random.gumbel(k, filtered.shape[1:]))(key)
            drawn = jnp.argmax(filtered + noise, axis=-1)
        return drawn.astype(jnp.int32)

    def no_draw():
        return jnp.zeros(greedy.shape, jnp.int32)

    drawn = jax.lax.cond(jnp.all(greedy), no_draw, draw)
    return jnp.where(greedy, jnp.argmax(logits, axis=-1), drawn).astype(jnp.int32)


def top_p_by_sort(logits: Float[Array, "batch vocab"], p: float) -> Float[Array, "batch vocab"]:
    """The previous top-p filter (a full argsort per row), kept as the reference the threshold
    search is tested against and the baseline of bench/sampling.py: keep a token while the
    probability mass before it in sorted order is still short of p."""
    order = jnp.argsort(-logits, axis=-1)
    sorted_probs = jax.nn.softmax(jnp.take_along_axis(logits, order, axis=-1), axis=-1)
    mass_before = jnp.cumsum(sorted_probs, axis=-1) - sorted_probs
    keep = (
        jnp.zeros_like(mass_before < p)
        .at[jnp.arange(logits.shape[0])[:, None], order]
        .set(mass_before < p)
    )
    return jnp.where(keep, logits, -jnp.inf)
