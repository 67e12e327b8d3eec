"""Log-probabilities from the engine (`submit(logprobs=N)`): every generated token's, and the N
most likely tokens' at its position, are a direct forward's log-softmax of the raw logits, for
greedy rows, hot sampled rows (raw: before temperature), tokens accepted from speculative
verification groups, and a prompt's first token; asking or not compiles nothing; bad values are
refused."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import infer
import zoo
from infer.engine import MAX_LOGPROBS, TRACES, Engine
from tests.infer.test_engine import LLAMA, prompts
from tests.infer.test_speculative import Oracle

_forward = eqx.filter_jit(lambda model, tokens: model(tokens))
WIDTH = 64  # every reference forward is right-padded to this (the causal mask ignores padding)


@pytest.fixture(scope="module")
def llama():
    return zoo.Transformer(LLAMA, key=jax.random.key(0))


def reference(model, prompt, tokens):
    """log_softmax of one full forward over prompt + tokens, at each generated token's
    position: [len(tokens), vocab]."""
    row = prompt + tokens
    logits = _forward(model, jnp.asarray([row + [0] * (WIDTH - len(row))]))[0]
    return np.asarray(jax.nn.log_softmax(logits, axis=-1))[len(prompt) - 1 : len(row) - 1]


def tolerance(expected: np.ndarray) -> float:
    """The engine and the reference compute the same float32 sums in different orders (paged
    attention by blocks of pages, a ragged batch): a sum of K terms is then off by at most
    K * eps of its magnitude (Higham's gamma_K). K is the longest reduction the logits pass
    through (d_ff, the vocabulary's log-sum-exp, the sequence), and the magnitude that of the
    log-probabilities."""
    longest = max(LLAMA.d_ff, LLAMA.vocab_size, WIDTH)
    return longest * float(np.finfo(np.float32).eps) * (1 + float(np.abs(expected).max()))


def check(model, request):
    """The request's entries against the reference: each token's value, and its top-N: the
    right count, most likely first, each value the reference's, none below the reference's
    N-th best (ties within the tolerance may list either token)."""
    expected = reference(model, request.prompt, request.tokens)
    tol = tolerance(expected)
    assert [e.token for e in request.token_logprobs] == request.tokens
    for entry, scores in zip(request.token_logprobs, expected, strict=True):
        assert abs(entry.logprob - scores[entry.token]) <= tol
        ids, values = (np.array(x) for x in zip(*entry.top, strict=True)) if entry.top else ([], [])
        assert len(entry.top) == request.logprobs and np.all(np.diff(values) <= 0)
        np.testing.assert_allclose(values, scores[ids], atol=tol, rtol=0)
        if request.logprobs:
            assert values[-1] >= np.sort(scores)[-request.logprobs] - tol


def engine_of(model, answers=()):
    """Every test's engine: one configuration (so its two programs compile once), speculating
    with drafts from known continuations (`answers`; none: no drafts)."""
    oracle = Oracle(k=3, answers=tuple(answers))
    return Engine(model, max_batch=2, max_len=64, page_size=8, chunk=16, speculative=oracle)


def greedy(model, prompt, n):
    """The greedy continuation by full forwards (the reference's compiled forward)."""
    tokens = []
    for _ in range(n):
        tokens.append(int(np.argmax(reference(model, prompt, [*tokens, 0])[-1])))
    return tokens


def test_logprobs_are_the_models_log_softmax_and_compile_nothing(llama):
    """Greedy, hot sampled (raw log-probabilities: not the tempered distribution) and plain
    requests in one batch, more requests than rows, N from 0 to the maximum."""
    engine = engine_of(llama)
    before = dict(TRACES)
    cases = zip(prompts([5, 20, 3, 9]), [0, 5, MAX_LOGPROBS, None], strict=True)
    hot = infer.Temperature(1.7)
    requests = [
        engine.submit(p, max_new_tokens=10, logprobs=n, sampler=hot if i % 2 else None)
        for i, (p, n) in enumerate(cases)
    ]
    engine.run()
    assert dict(TRACES) == before
    for request in requests[:3]:
        check(llama, request)
    assert all(e.top[0][0] == e.token for e in requests[2].token_logprobs)  # greedy: the top 1
    assert requests[3].token_logprobs == [] and len(requests[3].tokens) == 10


def test_tokens_accepted_from_a_verification_group_have_their_logprobs(llama):
    """Drafts partly kept (the oracle corrupts one in four), so steps emit several tokens per
    row: every emitted token, accepted draft or not, has the reference's log-probability."""
    cases = list(zip(prompts([6, 11], seed=2), [14, 9], strict=True))
    expected = [greedy(llama, p, n) for p, n in cases]
    engine = engine_of(llama, [p + t for (p, _), t in zip(cases, expected, strict=True)])
    requests = [engine.submit(p, max_new_tokens=n, logprobs=3) for p, n in cases]
    engine.run()
    assert sum(r.accepted for r in requests) > 0
    assert sum(r.drafted - r.accepted for r in requests) > 0
    for request, tokens in zip(requests, expected, strict=True):
        assert request.tokens == tokens
        check(llama, request)


def test_a_single_row_step_has_the_same_logprobs(llama):
    """One row decoding alone: the step's top-k then runs over a single row of logits (taken
    over the row twice, so XLA:GPU keeps it in its command buffer), with the same values."""
    engine = Engine(llama, max_batch=1, max_len=32, page_size=8, chunk=16)
    request = engine.submit(prompts([7], seed=3)[0], max_new_tokens=6, logprobs=MAX_LOGPROBS)
    engine.run()
    check(llama, request)


@pytest.mark.parametrize("bad", [-1, MAX_LOGPROBS + 1, 2.0, True, "5"])
def test_bad_logprobs_are_refused(llama, bad, without_runtime_typechecks):
    engine = Engine(llama, max_batch=1, max_len=32, page_size=8, chunk=16, warm_up=False)
    with pytest.raises(ValueError, match=r"logprobs must be None or an int in \[0, 20\]"):
        engine.submit([1, 2], max_new_tokens=2, logprobs=bad)
