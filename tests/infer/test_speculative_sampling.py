"""The rejection rule of speculative sampling gives the target's own distribution: a chi-square
test over many draws on a tiny model's distributions (the target under a top-k sampler, the
drafts from another tiny model), position by position, at a threshold derived from the test's
false-alarm rate; the same test fails on a deliberately wrong rule (a rejection redrawn from the
target instead of the residual)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import stats

import infer
import zoo
from infer.speculative import accept_sampled, verify
from infer.speculative.verify import target_probs
from tests.infer.test_engine import LLAMA

DRAWS = 40_000
DRAFTS = 2
# Under the null hypothesis the statistic is asymptotically chi-square with (bins - 1) degrees of
# freedom; at this false-alarm rate a correct rule fails once in a million runs.
FALSE_ALARM = 1e-6


@pytest.fixture(scope="module")
def setting():
    """Target logits (at 3 positions of a tiny model's forward), the row's sampler (top-8 at
    temperature 0.7) and the draft distributions q (perturbed by another tiny model, top-12)."""
    tokens = jnp.asarray([[3, 17, 99, 5, 42, 7]])
    target = zoo.Transformer(LLAMA, key=jax.random.key(0))
    draft = zoo.Transformer(LLAMA, key=jax.random.key(1))
    logits = target(tokens)[0, -(DRAFTS + 1) :] * 2.0  # sharper than a random model's
    # A draft that roughly agrees with the target, as a useful one does: the target's logits
    # perturbed by another model's.
    q_logits = logits[:DRAFTS] + draft(tokens)[0, -DRAFTS:]
    sampler = infer.TopK(8, temperature=0.7)
    q = jax.nn.softmax(infer.TopK(12, temperature=0.7).filter(q_logits / 0.7), axis=-1)
    return logits, sampler, q


def chi_square(tokens: np.ndarray, p: np.ndarray) -> tuple[float, float]:
    """Pearson's statistic of the tokens against p (tokens p gives no mass must not occur) and
    the threshold at FALSE_ALARM for its degrees of freedom."""
    counts = np.bincount(tokens, minlength=p.size)
    support = p > 0
    assert counts[~support].sum() == 0, "drew a token the target excludes"
    expected = tokens.size * p[support]
    assert expected.min() >= 5, "too few draws per bin for the chi-square approximation"
    statistic = float(np.sum((counts[support] - expected) ** 2 / expected))
    return statistic, float(stats.chi2.ppf(1 - FALSE_ALARM, support.sum() - 1))


def draws(setting, rule):
    logits, sampler, q = setting
    key_drafts, key_rule = jax.random.split(jax.random.key(7))
    drafts = jax.random.categorical(key_drafts, jnp.log(q), shape=(DRAWS, DRAFTS))
    rows = lambda x: jnp.broadcast_to(x, (DRAWS, *x.shape))  # noqa: E731
    k = jnp.full(DRAWS, DRAFTS)
    tokens, n = rule(rows(logits), drafts.astype(jnp.int32), k, rows(q), sampler, key_rule)
    return np.asarray(tokens), np.asarray(n)


def engine_rule(logits, drafts, k, q, sampler, key):
    params = jax.tree.map(lambda x: jnp.repeat(x, DRAWS), sampler.params())
    return jax.jit(verify)(logits, drafts, k, q, params, key)


def wrong_rule(logits, drafts, k, q, sampler, key):
    params = jax.tree.map(lambda x: jnp.repeat(x, DRAWS), sampler.params())
    p = target_probs(logits, params)
    return accept_sampled(p, drafts, k, q, key, rejected=lambda p, q: p)


def target(setting):
    logits, sampler, _ = setting
    return np.asarray(target_probs(logits[None], sampler.params())[0])


def test_speculative_sampling_draws_from_the_target(setting):
    tokens, n = draws(setting, engine_rule)
    p = target(setting)
    assert 0 < np.mean(n == 1) < 1 and np.any(n == DRAFTS + 1)  # rejections and full accepts
    for position in range(DRAFTS + 1):
        # The token at `position`, where the verification emitted one: the target's
        # distribution there (the positions' distributions are independent in this setting).
        statistic, threshold = chi_square(tokens[n > position, position], p[position])
        assert statistic < threshold, (position, statistic, threshold)


def test_a_wrong_rejection_rule_fails_the_same_test(setting):
    tokens, _ = draws(setting, wrong_rule)
    p = target(setting)
    statistic, threshold = chi_square(tokens[:, 0], p[0])
    assert statistic > threshold
