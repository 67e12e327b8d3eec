"""DeepSeek-V3's MTP module drafting in the engine (infer/speculative/mtp.py): greedy output is
each request's alone; the module's drafts after every step are what the module computes from
the whole sequence without a cache (so its own KV pages hold the right entries, whatever was
accepted); a model without the module is refused."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import zoo
from infer.engine import TRACES, Engine
from infer.sampling import Temperature
from infer.speculative import MTPDraft
from infer.speculative.mtp import TRACES as MTP_TRACES
from tests.infer.test_engine import _lowerings, alone, prompts
from zoo.mtp import MTP

CONFIG = zoo.preset("tiny-deepseek-v3")
POLICY = zoo.Policy(attention="naive", storage="unrolled")  # the specification's kernel


def scaled(tree, where, factor: float):
    """`tree` with every array leaf whose path contains one of `where` times `factor`."""

    def scale(path, leaf):
        name = jax.tree_util.keystr(path)
        return (
            leaf * factor if eqx.is_inexact_array(leaf) and any(w in name for w in where) else leaf
        )

    return jax.tree_util.tree_map_with_path(scale, tree)


@pytest.fixture(scope="module")
def drafting():
    """A target whose next token depends on its last token mostly (the layers' outputs scaled
    down), and an MTP module that reads that token's embedding (eh_proj the identity on it, the
    target's table, norm and head) plus a small contribution of its own attention and MLP: its
    drafts are mostly kept, not always, and depend on its KV cache."""
    target = zoo.Transformer(CONFIG, policy=POLICY, key=jax.random.key(1))
    target = scaled(target, ("o_proj", "down"), 0.05)
    mtp = MTP(CONFIG, policy=POLICY, key=jax.random.key(2))
    d = CONFIG.d_model
    identity = jnp.concatenate([jnp.eye(d), jnp.zeros((d, d))])  # [2d, d]: the embedding half
    mtp = eqx.tree_at(
        lambda m: (m.proj.weight, m.body.embed.weight, m.body.lm_head.weight,
                   m.body.final_norm.scale),
        mtp,
        (identity, target.embed.weight, target.lm_head.weight, target.final_norm.scale),
    )  # fmt: skip
    mtp = eqx.tree_at(lambda m: m.body, mtp, scaled(mtp.body, ("o_proj", "down"), 0.5))
    return target.with_mtp(mtp)


@eqx.filter_jit
def _module_log_probs(model, tokens):
    hidden = model.final_norm(model.forward(tokens[:, :-1]).hidden)
    return jax.nn.log_softmax(model.mtp.forward(tokens[:, 1:], hidden).logits[0], axis=-1)


def reference_drafts(model, sequence: list[int]) -> np.ndarray:
    """The module's log-probabilities of the token after each prefix `sequence[:m]` (row
    `m - 2`) from full forwards: the target's hidden states over the sequence, the module over
    the next tokens (causal: a prefix's rows are the prefix's own, so the sequence is
    right-padded to a multiple of 64 tokens and one compiled forward serves every length)."""
    width = -(-len(sequence) // 64) * 64
    tokens = jnp.asarray([sequence + [0] * (width - len(sequence))])
    return np.asarray(_module_log_probs(model, tokens))[: len(sequence) - 1]


def test_mtp_drafts_are_the_modules_and_greedy_output_is_greedys(drafting):
    """Prompts longer than a chunk (the module's input crosses chunks), two rows, k = 3: after
    each step, each running row's first draft distribution is the module's reference."""
    cases = list(zip(prompts([21, 6]), [14, 11], strict=True))
    expected = [alone(drafting, p, n) for p, n in cases]
    engine = Engine(drafting, max_batch=2, max_len=64, page_size=8, chunk=16,
                    speculative=MTPDraft(k=3))  # fmt: skip
    seen = []  # (sequence so far, the engine's first-draft log-probabilities for what follows)

    def watch(request):
        def on_tokens(tokens):
            sequence = request.prompt + request.tokens  # tokens already appended
            q = np.log(np.asarray(engine.drafter.q[request.row, 0]))
            seen.append((sequence, q))  # each request's prefix: no other has its prompt

        return on_tokens

    requests = [engine.submit(p, max_new_tokens=n) for p, n in cases]
    for request in requests:  # before the first step: every piece of tokens is watched
        request.on_tokens = watch(request)
    engine.run()
    assert [r.tokens for r in requests] == expected
    kept = sum(r.accepted for r in requests)
    assert 0 < kept < sum(r.drafted for r in requests)  # some drafts kept, some not
    assert len(seen) > 4
    for request in requests:
        sequence = request.prompt + request.tokens
        expected = reference_drafts(drafting, sequence)
        # float32 (paged attention and the cache's order of sums against full forwards):
        # roundings over a d_model-long sum, times the log-probabilities' size.
        tolerance = CONFIG.d_model * np.finfo(np.float32).eps * np.abs(expected).max()
        for prefix, q in seen:
            if sequence[: len(prefix)] == prefix:
                np.testing.assert_allclose(q, expected[len(prefix) - 2], atol=tolerance, rtol=0)


def test_nothing_compiles_for_new_requests_or_sampling(drafting):
    kwargs = dict(max_batch=2, max_len=64, page_size=8, chunk=16, speculative=MTPDraft(k=3))
    Engine(drafting, **kwargs)  # compiles the programs (or the test above did)
    before = dict(TRACES), dict(MTP_TRACES)
    engine = Engine(drafting, **kwargs)

    def run():
        for prompt in prompts([3, 30, 9]):
            engine.submit(prompt, max_new_tokens=8, sampler=Temperature(0.8))
        engine.run()

    # Nor lowered again: the module's pools are committed from the start, as its programs'
    # outputs are (an uncommitted first state was another lowering of its decode programs).
    assert _lowerings(run) == 0
    assert (dict(TRACES), dict(MTP_TRACES)) == before


def test_a_model_without_the_module_is_refused(without_runtime_typechecks):
    model = zoo.Transformer(CONFIG, policy=POLICY, key=jax.random.key(1))
    with pytest.raises(ValueError, match=r"this model has none \(model.mtp is None\)"):
        Engine(model, max_batch=1, max_len=64, warm_up=False, speculative=MTPDraft(k=2))
    with pytest.raises(ValueError, match="MTPDraft k must be an int >= 1"):
        MTPDraft(k=0)


def test_a_cut_vocabulary_drafts_only_its_tokens_and_keeps_the_output(drafting):
    """The module's head cut to every token, shuffled: the drafts map back to the same ids (the
    same kept and drafted counts as the whole head). Cut to half the tokens: drafts come only
    from that half, and the greedy output is still each request's alone."""
    prompt, n = prompts([21])[0], 14
    expected = alone(drafting, prompt, n)
    vocab = np.random.default_rng(0).permutation(CONFIG.vocab_size)
    runs = {}
    for name, ids in (("whole", None), ("shuffled", vocab), ("half", vocab[::2])):
        # The first test's engine configuration: the whole head's programs are compiled already.
        engine = Engine(drafting, max_batch=2, max_len=64, page_size=8, chunk=16, warm_up=False,
                        speculative=MTPDraft(k=3, vocab=ids))  # fmt: skip
        drafts = []
        request = engine.submit(prompt, max_new_tokens=n)
        request.on_tokens = lambda _, e=engine, d=drafts: d.append(np.asarray(e.drafter.drafts[0]))
        engine.run()
        assert request.tokens == expected, name
        runs[name] = (request.accepted, request.drafted, np.concatenate(drafts))
    assert runs["shuffled"][:2] == runs["whole"][:2]
    np.testing.assert_array_equal(runs["shuffled"][2], runs["whole"][2])
    assert set(runs["half"][2].tolist()) <= set(vocab[::2].tolist())


def test_a_bad_vocabulary_is_refused(without_runtime_typechecks):
    with pytest.raises(ValueError, match="MTPDraft vocab must be a non-empty 1-D array"):
        MTPDraft(k=2, vocab=[[1, 2]])
    with pytest.raises(ValueError, match="MTPDraft vocab must hold distinct token ids"):
        MTPDraft(k=2, vocab=[3, 3])
    model = zoo.Transformer(CONFIG, policy=POLICY, key=jax.random.key(1))
    model = model.with_mtp(MTP(CONFIG, policy=POLICY, key=jax.random.key(2)))
    too_high = MTPDraft(k=2, vocab=[1, CONFIG.vocab_size])
    with pytest.raises(ValueError, match=rf"distinct token ids in \[0, {CONFIG.vocab_size}\)"):
        Engine(model, max_batch=1, max_len=64, warm_up=False, speculative=too_high)
