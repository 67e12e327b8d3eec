"""Sampler statistics: kept sets of top-k / top-p / min-p, temperature -> 0 is greedy, seeds;
the sort-free threshold search equals the argsort filter it replaced; one compiled sampler serves
any mix of settings."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

import infer
from infer.sampling import SamplingParams, filter_logits, sample, stack_samplers, top_p_by_sort

LOGITS = jax.random.normal(jax.random.key(0), (16, 40)) * 3.0
KEYS = jax.random.split(jax.random.key(1), 300)


def draws(sampler, logits=LOGITS):
    """[n_keys, batch] tokens, one draw per key."""
    return np.asarray(jax.vmap(lambda k: sampler(logits, k))(KEYS))


def test_top_k_never_leaves_the_k_largest():
    k = 5
    top = np.argsort(-np.asarray(LOGITS), axis=-1)[:, :k]
    tokens = draws(infer.TopK(k=k, temperature=2.0))
    for row in range(LOGITS.shape[0]):
        assert set(tokens[:, row]) <= set(top[row])
    assert len(set(tokens[:, 0])) > 1  # it does sample, not just argmax


@pytest.mark.parametrize("temperature", [0.0, 1e-4])
def test_temperature_to_zero_is_greedy(temperature):
    tokens = draws(infer.Temperature(temperature=temperature))
    np.testing.assert_array_equal(tokens, np.broadcast_to(np.argmax(LOGITS, -1), tokens.shape))


def test_same_key_same_tokens_and_frequencies_follow_softmax():
    sampler = infer.Temperature(temperature=1.0)
    logits = jnp.log(jnp.array([[0.5, 0.3, 0.15, 0.05]]))
    np.testing.assert_array_equal(draws(sampler, logits), draws(sampler, logits))
    keys = jax.random.split(jax.random.key(2), 4000)
    tokens = np.asarray(jax.vmap(lambda k: sampler(logits, k))(keys))[:, 0]
    np.testing.assert_allclose(
        np.bincount(tokens, minlength=4) / 4000, [0.5, 0.3, 0.15, 0.05], atol=0.03
    )


PROBS = jnp.log(jnp.array([[0.5, 0.3, 0.15, 0.05]]))


@pytest.mark.parametrize(
    ("sampler", "kept"),
    [
        (infer.TopP(p=0.5), {0}),
        (infer.TopP(p=0.8), {0, 1}),
        (infer.TopP(p=0.81), {0, 1, 2}),
        (infer.TopP(p=1.0), {0, 1, 2, 3}),
        (infer.MinP(p=0.5), {0, 1}),
        (infer.MinP(p=0.3), {0, 1, 2}),
        (infer.TopK(k=3), {0, 1, 2}),
    ],
)
def test_filters_keep_the_right_set(sampler, kept):
    filtered = np.asarray(sampler.filter(PROBS))[0]
    assert set(np.flatnonzero(np.isfinite(filtered))) == kept
    assert set(draws(sampler, PROBS)[:, 0]) == kept


def test_top_p_on_shuffled_vocab_keeps_the_most_likely():
    # The kept set must follow probability, not index order.
    logits = jnp.log(jnp.array([[0.05, 0.3, 0.15, 0.5]]))
    filtered = np.asarray(infer.TopP(p=0.8).filter(logits))[0]
    assert set(np.flatnonzero(np.isfinite(filtered))) == {1, 3}


# The threshold search against the previous argsort implementation (infer.sampling.top_p_by_sort)
# and against exact arithmetic. Shapes are fixed so that each filter compiles once.

ROWS, VOCAB = 4, 48
# XLA flushes subnormal floats to zero (comparisons included), so the logits are normal floats.
# Two float32 sums of up to VOCAB probabilities (the search's and the reference's) each round by
# at most VOCAB * eps: a token whose exact mass-before is this close to p may go either way.
SLACK = 2 * VOCAB * float(np.finfo(np.float32).eps)

logit_rows = hnp.arrays(
    np.float32,
    (ROWS, VOCAB),
    elements=st.floats(-20, 20, width=32, allow_subnormal=False),
    unique=False,
)
distinct_logit_rows = hnp.arrays(
    np.float32,
    (ROWS, VOCAB),
    elements=st.floats(-20, 20, width=32, allow_subnormal=False),
    unique=True,
)
probabilities = hnp.arrays(
    np.float32, (ROWS,), elements=st.floats(float(np.float32(0.01)), 1.0, width=32)
)


def params(top_k=0, top_p=1.0, min_p=0.0, temperature=1.0) -> SamplingParams:
    return SamplingParams(
        temperature=np.broadcast_to(np.float32(temperature), (ROWS,)),
        top_k=np.broadcast_to(np.asarray(top_k, np.int32), (ROWS,)),
        top_p=np.broadcast_to(np.asarray(top_p, np.float32), (ROWS,)),
        min_p=np.broadcast_to(np.asarray(min_p, np.float32), (ROWS,)),
    )


def kept(filtered) -> np.ndarray:
    return np.isfinite(np.asarray(filtered))


def exact_mass_before(logits: np.ndarray) -> np.ndarray:
    """Per token, the float64 probability of the tokens strictly more likely than it."""
    x = logits.astype(np.float64)
    probs = np.exp(x - x.max(axis=-1, keepdims=True))
    probs /= probs.sum(axis=-1, keepdims=True)
    return np.einsum("btj,bj->bt", x[:, None, :] > x[:, :, None], probs)


def assert_same_set_away_from_p(got, want, logits, p):
    """Equal kept sets, except tokens whose exact mass-before lies within SLACK of p."""
    decidable = np.abs(exact_mass_before(logits) - p[:, None]) > SLACK
    np.testing.assert_array_equal(got[decidable], want[decidable])


@settings(max_examples=150, deadline=None)
@given(logits=logit_rows, p=probabilities)
def test_top_p_keeps_the_exact_nucleus(logits, p):
    """Ties included: a token stays iff the tokens strictly more likely than it weigh < p."""
    got = kept(filter_logits(jnp.asarray(logits), params(top_p=p)))
    assert got[np.arange(ROWS), logits.argmax(-1)].all()  # the most likely token always stays
    assert_same_set_away_from_p(got, exact_mass_before(logits) < p[:, None], logits, p)


@settings(max_examples=150, deadline=None)
@given(
    logits=distinct_logit_rows,
    p=st.floats(float(np.float32(0.01)), 1.0, width=32),
    temperature=st.floats(float(np.float32(0.1)), 5.0, width=32),
)
def test_top_p_keeps_the_same_set_as_the_argsort_filter(logits, p, temperature):
    tempered = jnp.asarray(logits) / np.float32(temperature)
    # The argsort filter breaks ties by index (tempering can create ties by underflow); the
    # search keeps tied tokens together (test_top_p_keeps_the_exact_nucleus covers ties).
    assume(all(len(np.unique(row)) == VOCAB for row in np.asarray(tempered)))
    got = kept(filter_logits(tempered, params(top_p=p)))
    want = kept(top_p_by_sort(tempered, p))
    assert_same_set_away_from_p(got, want, np.asarray(tempered), np.full(ROWS, p))


@settings(max_examples=150, deadline=None)
@given(logits=logit_rows, k=st.integers(1, VOCAB + 5))
def test_top_k_keeps_the_same_set_as_lax_top_k(logits, k):
    """Exact, ties included: every token >= the k-th largest logit (k > vocab keeps all)."""
    got = kept(filter_logits(jnp.asarray(logits), params(top_k=k)))
    kth = jax.lax.top_k(logits, min(k, VOCAB))[0][:, -1:]
    np.testing.assert_array_equal(got, logits >= kth)


@settings(max_examples=100, deadline=None)
@given(
    logits=distinct_logit_rows,
    k=st.integers(1, 20),
    p=st.floats(float(np.float32(0.05)), float(np.float32(0.95)), width=32),
)
def test_top_k_then_top_p_renormalises_over_the_survivors(logits, k, p):
    """Both in one row compose as HF's warpers do: top-p over the top-k tokens' softmax."""
    got = kept(filter_logits(jnp.asarray(logits), params(top_k=k, top_p=p)))
    kth = jax.lax.top_k(logits, k)[0][:, -1:]
    survivors = np.where(logits >= kth, logits, -np.inf)
    want = kept(top_p_by_sort(jnp.asarray(survivors), p))
    assert_same_set_away_from_p(got, want, survivors, np.full(ROWS, p))


@settings(max_examples=50, deadline=None)
@given(logits=logit_rows, min_p=probabilities)
def test_min_p_keeps_tokens_within_a_factor_of_the_most_likely(logits, min_p):
    got = kept(filter_logits(jnp.asarray(logits), params(min_p=min_p)))
    probs = np.exp(logits.astype(np.float64) - logits.max(-1, keepdims=True))
    ratio_margin = np.abs(probs / min_p[:, None] - 1) > 1e-5  # away from the boundary
    np.testing.assert_array_equal(got[ratio_margin], (probs >= min_p[:, None])[ratio_margin])


def test_same_key_same_tokens_as_the_argsort_sampler():
    """Same kept set, same categorical draw: TopP gives the old sampler's tokens key for key."""
    logits = jax.random.normal(jax.random.key(3), (8, 1000)) * 2.0
    sampler = infer.TopP(p=0.7, temperature=0.8)

    @jax.jit
    def old(key):
        return jax.random.categorical(key, top_p_by_sort(logits / np.float32(0.8), 0.7), axis=-1)

    keys = jax.random.split(jax.random.key(4), 50)
    np.testing.assert_array_equal(jax.vmap(lambda k: sampler(logits, k))(keys), jax.vmap(old)(keys))


def test_one_batch_mixes_samplers_row_by_row():
    samplers = [infer.Greedy(), infer.TopK(2), infer.TopP(0.8), infer.MinP(0.5),
                infer.Temperature(1.0), infer.TopK(3, temperature=0.0)]  # fmt: skip
    batch = stack_samplers(samplers)
    logits = jnp.broadcast_to(PROBS, (len(samplers), 4))
    keys = jax.random.split(jax.random.key(5), 4000)
    tokens = np.asarray(jax.vmap(lambda k: sample(logits, batch, k))(keys))
    assert [set(tokens[:, row]) for row in range(len(samplers))] == [
        {0}, {0, 1}, {0, 1}, {0, 1}, {0, 1, 2, 3}, {0},
    ]  # fmt: skip
    for row in (1, 2, 3):  # renormalised over the kept pair
        np.testing.assert_allclose(np.mean(tokens[:, row] == 0), 0.5 / 0.8, atol=0.03)


def test_new_settings_reuse_the_compiled_sampler():
    traces = []

    @eqx.filter_jit
    def step(sampler, logits, key):
        traces.append(type(sampler).__name__)
        return sampler(logits, key)

    for p in (0.5, 0.7, 0.95):
        step(infer.TopP(p=p, temperature=2.0 * p), LOGITS, jax.random.key(0))
    for k in (1, 5):
        step(infer.TopK(k=k), LOGITS, jax.random.key(0))
    assert traces == ["TopP", "TopK"]
    mixes = [[infer.Greedy(), infer.TopP(0.9)], [infer.MinP(0.2), infer.TopK(7, 0.5)]]
    for mix in mixes:
        sample(LOGITS[:2], stack_samplers(mix), jax.random.key(0))
    assert sample._cache_size() == 1


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (
            lambda: infer.Temperature(float("nan")),
            r"temperature must be >= 0 and finite \(0 means greedy\), got nan",
        ),
        (lambda: infer.TopP(0.5, temperature=float("inf")), "temperature .* got inf"),
        (lambda: infer.MinP(0.5, temperature=-1.0), "temperature .* got -1.0"),
        (lambda: infer.TopP(p=float("nan")), r"TopP.p \(top-p\) must be in \(0, 1\], got nan"),
        (lambda: infer.MinP(p=-0.1), r"MinP.p \(min-p\) must be in \[0, 1\], got -0.1"),
        (lambda: infer.TopK(k=2.5), "TopK.k must be an integer, got 2.5"),
        (lambda: infer.TopK(k=True), "TopK.k must be an integer, got True"),
        (lambda: infer.TopK(k=-3), r"TopK.k must be >= 1 and < 2\*\*31, got -3"),
        (lambda: params(top_p=[0.5, 1.5, 1, 1]), r"SamplingParams.top_p must be in \(0, 1\]"),
        (
            lambda: params(top_k=[0, -1, 0, 0]),
            "SamplingParams.top_k must be >= 0 and < 2\\*\\*31, got -1",
        ),
        (
            lambda: SamplingParams(
                temperature=np.ones(1), top_k=np.zeros(2, int), top_p=np.ones(1), min_p=np.zeros(1)
            ),
            "1-D arrays of one length",
        ),
        (lambda: stack_samplers([]), "at least one sampler"),
        (
            lambda: sample(LOGITS[:2], stack_samplers([infer.Greedy()] * 3), jax.random.key(0)),
            "SamplingParams has 3 rows, cannot serve 2",
        ),
    ],
)
def test_bad_settings_name_the_parameter(without_runtime_typechecks, make, message):
    with pytest.raises(ValueError, match=message):
        make()
