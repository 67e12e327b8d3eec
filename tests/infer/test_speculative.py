"""Speculative decoding in the engine: greedy output is each request's alone (the greedy
specification of tests/infer/test_engine.py) on the tiny config of every family whose attention
or cache verifies in its own way, whatever the drafts (all kept, some, none), with rows of
different k and rows without speculation in one batch; stop tokens and budgets inside an
accepted run; nothing compiles as k or acceptance vary; prompt lookup finds its n-grams; bad
input is refused."""

import dataclasses

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import infer
import zoo
from infer.engine import TRACES, WARM_UP_TIMINGS, Engine
from infer.speculative import (
    DraftModel,
    PromptLookup,
    Proposer,
    check_tokenizers,
    draft_vocab,
    truncated_draft,
)
from infer.speculative.adaptive import (
    DECAY,
    PRIOR_KEPT,
    PRIOR_TRIED,
    Acceptance,
    StepCosts,
    drafts_that_pay,
)
from infer.speculative.draft import DRAFT_VOCAB, draw_drafts, head_rows
from infer.speculative.draft import TRACES as DRAFT_TRACES
from tests.infer.test_engine import FAMILIES, LLAMA, _lowerings, alone, prompts


class Oracle(Proposer):
    """Drafts from known continuations (`answers`: prompt + greedy tokens), with the draft at
    index `len(tokens) % (k + 1)` corrupted when `corrupt`: acceptance then varies from all to
    none across steps, as a real proposer's does."""

    k: int
    answers: tuple
    corrupt: bool = True

    def propose(self, tokens, k):
        tokens = list(tokens)
        for answer in self.answers:
            if list(answer[: len(tokens)]) == tokens:
                drafts = np.array(answer[len(tokens) : len(tokens) + k], np.int64)
                wrong = len(tokens) % (k + 1)
                if self.corrupt and wrong < drafts.size:
                    drafts[wrong] = (drafts[wrong] + 1) % 256
                return drafts
        return np.zeros(0, np.int64)


# One engine shape and k = 4 for the tests on `llama`: their programs (plain, verifying k = 4,
# with and without prompt chunks) compile once per module. Engines built with warm_up=False
# compile only the step shapes their requests use, and find the ones compiled before.
SHAPE = dict(max_batch=2, max_len=64, page_size=8, chunk=16)


def greedy(model, cases, **kwargs):
    engine = Engine(model, **SHAPE, warm_up=False, **kwargs)
    requests = [engine.submit(p, max_new_tokens=n) for p, n in cases]
    engine.run()
    return [r.tokens for r in requests]


@pytest.fixture(scope="module")
def llama():
    return zoo.Transformer(LLAMA, key=jax.random.key(0))


# What a family changes in verification is how its attention and caches take a group of new
# positions and a rollback: positions (gpt2, llama's rope), rings and window patterns (mistral,
# gemma2, gemma3), latent caches (deepseek-v3), each token's experts (mixtral, qwen3-moe,
# deepseek-moe). Qwen2's q/k/v biases and Qwen3's q/k norms act on each token alone, on llama's
# path (test_engine runs them in ragged steps).
VERIFIED = [family for family in FAMILIES if family not in ("qwen2", "qwen3")]


@pytest.mark.parametrize("family", VERIFIED)
def test_speculative_greedy_equals_greedy_on_every_family(family):
    """Drafts kept, partly kept and rejected, rows asking for k = 3, 1 and 0 (no speculation)
    in one batch, more requests than rows: every request gets the non-speculative tokens."""
    policy = zoo.Policy(attention="naive", storage="unrolled")  # the specification's kernel
    model = zoo.Transformer(FAMILIES[family], policy=policy, key=jax.random.key(1))
    cases = list(zip(prompts([5, 20, 3, 9]), [9, 7, 1, 8], strict=True))
    expected = [alone(model, p, n) for p, n in cases]
    oracle = Oracle(k=3, answers=tuple(p + t for (p, _), t in zip(cases, expected, strict=True)))
    engine = Engine(
        model, max_batch=2, max_len=64, page_size=8, chunk=16, speculative=oracle, warm_up=False
    )
    requests = [
        engine.submit(p, max_new_tokens=n, draft_tokens=d)
        for (p, n), d in zip(cases, [3, 1, 3, 0], strict=True)
    ]
    engine.run()
    assert [r.tokens for r in requests] == expected
    assert sum(r.accepted for r in requests) > 0  # speculation did emit several tokens a step
    assert sum(r.drafted - r.accepted for r in requests) > 0  # and some drafts were rejected
    assert requests[3].drafted == 0 and engine.pool.in_use == 0


def test_good_drafts_emit_k_plus_one_tokens_per_step_and_stop_inside_a_run(llama):
    cases = [(prompts([6])[0], 13)]
    (expected,) = greedy(llama, cases)
    answers = (cases[0][0] + expected,)
    oracle = Oracle(k=4, answers=answers, corrupt=False)
    engine = Engine(llama, **SHAPE, speculative=oracle, warm_up=False)
    request = engine.submit(cases[0][0], max_new_tokens=13)
    engine.run()
    # One prefill step gives the first token, then 12 tokens in steps of 5, 5 and 2 (the
    # budget caps the last step's drafts at one).
    assert request.tokens == expected and engine.steps == 4
    assert (request.drafted, request.accepted) == (9, 9)
    stop = expected[7]  # emitted inside the second step's accepted run
    request = engine.submit(cases[0][0], max_new_tokens=13, stop_tokens=[stop])
    engine.run()
    assert request.tokens == expected[: expected.index(stop) + 1]


def test_nothing_compiles_as_k_acceptance_or_samplers_vary(llama):
    cases = list(zip(prompts([4, 30, 11, 17], seed=3), [12, 5, 9, 3], strict=True))
    expected = greedy(llama, cases)
    answers = tuple(p + t for (p, _), t in zip(cases, expected, strict=True))
    Engine(llama, speculative=Oracle(k=4, answers=answers), **SHAPE)  # compiles both programs
    before = dict(TRACES)
    for corrupt in (True, False):
        engine = Engine(llama, speculative=Oracle(k=4, answers=answers, corrupt=corrupt), **SHAPE)
        requests = [
            engine.submit(p, max_new_tokens=n, draft_tokens=d)
            for (p, n), d in zip(cases, [4, 2, 0, 1], strict=True)
        ]
        engine.submit([1, 2, 3], max_new_tokens=6, sampler=infer.TopP(0.8, temperature=0.7))
        engine.run()
        assert [r.tokens for r in requests] == expected
    assert dict(TRACES) == before


def test_prompt_lookup_proposes_what_followed_the_latest_match():
    lookup = PromptLookup(k=3, max_ngram=2)
    tokens = np.array([5, 6, 7, 8, 9, 1, 6, 7, 2, 3, 6, 7])
    # The tail bigram (6, 7) last occurred before (2, 3, 6): its continuation.
    assert lookup.propose(tokens, 3).tolist() == [2, 3, 6]
    assert lookup.propose(tokens, 1).tolist() == [2]
    # Only a unigram matches: the latest earlier 9 was followed by 1.
    assert lookup.propose(np.array([9, 1, 4, 9]), 3).tolist() == [1, 4, 9]
    assert lookup.propose(np.array([1, 2, 3]), 3).size == 0  # nothing recurs


def test_prompt_lookup_in_the_engine_equals_greedy(llama):
    """A prompt that repeats itself: the lookup proposes, the target verifies."""
    rng = np.random.default_rng(7)
    chunk = rng.integers(0, 256, 10).tolist()
    cases = [(chunk * 3, 12), (rng.integers(0, 256, 9).tolist(), 8)]
    expected = greedy(llama, cases)
    engine = Engine(llama, **SHAPE, speculative=PromptLookup(k=4, adaptive=False), warm_up=False)
    requests = [engine.submit(p, max_new_tokens=n) for p, n in cases]
    engine.run()
    assert [r.tokens for r in requests] == expected
    assert requests[0].drafted > 0


@pytest.mark.parametrize(
    "make, message",
    [
        (lambda: PromptLookup(k=0), "PromptLookup k must be an int >= 1"),
        (lambda: PromptLookup(k=True), "PromptLookup k must be an int >= 1"),
        (lambda: PromptLookup(max_ngram=2, min_ngram=3), "max_ngram must be an int >= 3"),
    ],
)
def test_bad_proposers_are_refused(make, message, without_runtime_typechecks):
    with pytest.raises(ValueError, match=message):
        make()


@pytest.mark.parametrize(
    "engine_kwargs, submit_kwargs, message",
    [
        ({"speculative": "ngram"}, {}, "speculative must be a proposer"),
        ({"speculative": PromptLookup(k=2)}, {"draft_tokens": 3},
         r"draft_tokens must be an int in \[0, 2\] .* got 3"),
        ({"speculative": PromptLookup(k=2)}, {"draft_tokens": -1}, r"in \[0, 2\]"),
        ({"speculative": PromptLookup(k=2)}, {"draft_tokens": 1.0}, r"in \[0, 2\]"),
        ({}, {"draft_tokens": 2}, "draft_tokens=2, but the engine does not speculate"),
    ],
)  # fmt: skip
def test_bad_speculation_is_refused(
    llama, engine_kwargs, submit_kwargs, message, without_runtime_typechecks
):
    with pytest.raises(ValueError, match=message):
        engine = Engine(llama, max_batch=1, max_len=64, chunk=16, warm_up=False, **engine_kwargs)
        engine.submit([1, 2, 3], max_new_tokens=4, **submit_kwargs)


def test_generate_takes_a_proposer(llama):
    chunk = prompts([8], seed=11)[0]
    batch = [chunk * 3, prompts([5], seed=12)[0]]
    plain = infer.generate(llama, batch, max_new_tokens=10, sampler=infer.Greedy(),
                           key=jax.random.key(0))  # fmt: skip
    speculating = infer.generate(llama, batch, max_new_tokens=10, sampler=infer.Greedy(),
                                 key=jax.random.key(0), speculative=PromptLookup(k=3))  # fmt: skip
    assert speculating == plain


def test_smollm2_repeating_its_input_keeps_most_drafts_and_the_greedy_tokens():
    """The real checkpoint on an input-grounded task: prompt lookup's drafts are mostly kept,
    far fewer target forwards, and the tokens are the plain engine's."""
    from tests.reference.runner import smollm2_gguf

    gguf = smollm2_gguf()
    tokenizer = zoo.load_tokenizer(gguf)
    # Stacked layers: one scanned block to compile instead of 30 (verification and rollback
    # work on the pages, whatever the storage: test_engine runs both on every family).
    model = zoo.load_pretrained(gguf, quantized=False).with_policy(storage="stacked")
    text = "Repeat exactly: the ferry crosses to the island twice a day, at dawn and at dusk."
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": text}], add_generation_prompt=True
    )
    results = []
    for speculative in (None, PromptLookup(k=4, adaptive=False)):
        # warm_up=False: only the step shapes this request uses compile.
        engine = Engine(
            model, max_batch=1, max_len=128, chunk=64, speculative=speculative, warm_up=False
        )
        request = engine.submit(prompt, max_new_tokens=20)
        engine.run()
        results.append((request.tokens, engine.steps, request))
    (plain, plain_steps, _), (tokens, steps, request) = results
    assert tokens == plain
    assert request.accepted > request.drafted / 2 and steps < plain_steps / 2


def test_a_draft_model_proposes_in_its_own_cache(llama):
    """A one-layer draft: the greedy tokens are the target's alone. The target as its own draft
    (its cache fed the same chunks, catch-ups and rollbacks as the target's) has every draft
    kept, greedy or sampled (then p = q up to float rounding, so the rule keeps them all but
    rarely): the draft's pages, lengths and q are right."""
    small = zoo.Transformer(dataclasses.replace(LLAMA, n_layers=1), key=jax.random.key(3))
    cases = list(zip(prompts([4, 30, 11, 17], seed=3), [12, 5, 9, 3], strict=True))
    expected = [alone(llama, p, n) for p, n in cases]
    for draft in (small, llama):
        engine = Engine(llama, speculative=DraftModel(draft, k=4, adaptive=False), **SHAPE)
        requests = [engine.submit(p, max_new_tokens=n) for p, n in cases]
        engine.run()
        assert [r.tokens for r in requests] == expected
    assert all(r.accepted == r.drafted > 0 for r in requests[:3])
    before = dict(TRACES), dict(DRAFT_TRACES)
    engine = Engine(
        llama, speculative=DraftModel(llama, k=4, adaptive=False), key=jax.random.key(2), **SHAPE
    )
    hot = [engine.submit(p, max_new_tokens=12, sampler=infer.Temperature(1.5)) for p, _ in cases]
    engine.run()
    assert sum(r.accepted for r in hot) >= 0.9 * sum(r.drafted for r in hot) > 0
    assert (dict(TRACES), dict(DRAFT_TRACES)) == before  # nothing new for sampling rows


def test_a_draft_vocabulary_cuts_the_head_and_keeps_the_greedy_tokens(llama):
    """The target as its own draft with its head cut to a shuffled vocabulary: drafts are the
    target's own tokens, so every draft is kept when the vocabulary holds every token the
    output uses (the ids map back), and one that lacks some of them has those drafts rejected
    and the same greedy tokens."""
    cases = list(zip(prompts([4, 30, 11], seed=3), [12, 5, 9], strict=True))
    expected = [alone(llama, p, n) for p, n in cases]
    used = {t for tokens in expected for t in tokens}
    rng = np.random.default_rng(0)
    unused = [t for t in rng.permutation(LLAMA.vocab_size) if t not in used]
    # Two vocabularies of one size (one draft program): without 8 unused tokens, or without 8
    # tokens the greedy outputs hold.
    covering = [t for t in rng.permutation(LLAMA.vocab_size) if t not in unused[:8]]
    missing = sorted(used)[:8]
    lacking = [t for t in rng.permutation(LLAMA.vocab_size) if t not in missing]
    for vocab in (covering, lacking):
        proposer = DraftModel(llama, k=4, adaptive=False, vocab=np.asarray(vocab))
        engine = Engine(llama, speculative=proposer, **SHAPE, warm_up=False)
        requests = [engine.submit(p, max_new_tokens=n) for p, n in cases]
        engine.run()
        drafted, kept = (sum(getattr(r, f) for r in requests) for f in ("drafted", "accepted"))
        assert [r.tokens for r in requests] == expected
        if vocab is covering:
            assert kept == drafted > 0
        else:  # a missing token is never drafted: its verification rejects what stood there
            assert 0 < kept < drafted and sum(r.rejected for r in requests) > 0


def test_drafts_over_a_cut_vocabulary_map_back_to_the_vocabulary():
    """Logits over a vocabulary's ids: the greedy draft is the id of the best, a sampled one
    is drawn from q, and q is each row's distribution over the ids, put at the ids (0 at the
    others) — what the rejection rule takes as the draft's distribution."""
    vocab = jnp.asarray([7, 2, 9, 4], jnp.int32)
    logits = jnp.asarray([[0.0, 3.0, 1.0, -1.0], [2.0, 0.0, 0.0, 5.0]])
    rows = lambda sampler: jax.tree.map(lambda x: jnp.repeat(x, 2), sampler.params())  # noqa: E731
    tokens, q = draw_drafts(logits, rows(infer.Greedy()), jax.random.key(0), vocab, 12)
    assert tokens.tolist() == [2, 4] and q.shape == (2, 12)
    tokens, q = draw_drafts(logits, rows(infer.Temperature(1.0)), jax.random.key(0), vocab, 12)
    expected = np.zeros((2, 12), np.float32)
    expected[:, np.asarray(vocab)] = jax.nn.softmax(logits, axis=-1)
    np.testing.assert_allclose(q, expected, rtol=1e-6, atol=0)
    assert all(int(t) in vocab.tolist() for t in tokens)


def test_a_quantized_heads_rows_are_cut_packed_as_it_is(llama):
    """int8 rows come back with the same codes and per-row scales (float rounding)."""
    quantized = zoo.quantize(llama, "int8")
    ids = np.random.default_rng(1).permutation(LLAMA.vocab_size)[:40]
    rows = head_rows(quantized, jnp.asarray(ids))
    whole = quantized.embed if quantized.lm_head is None else quantized.lm_head
    table = whole.dequantize().weight
    table = table[ids] if quantized.lm_head is None else table[:, ids].T
    assert type(rows).__name__ == "QuantizedEmbedding" and rows.kind == "int8"
    scale = float(np.abs(table).max())
    np.testing.assert_allclose(rows.dequantize().weight, table, rtol=0, atol=4 * 2**-24 * scale)


@pytest.mark.parametrize(
    "vocab, message",
    [
        (np.zeros((2, 3), np.int32), "non-empty 1-D array of token ids"),
        (np.zeros(0, np.int32), "non-empty 1-D array of token ids"),
        (np.array([1.0, 2.0]), "non-empty 1-D array of token ids"),
        (np.array([0, 256]), r"distinct token ids in \[0, 256\).*from 0 to 256"),
        (np.array([-1, 3]), r"distinct token ids in \[0, 256\)"),
        (np.array([3, 5, 3]), "1 repeated"),
    ],
)
def test_bad_draft_vocabularies_are_refused(llama, vocab, message, without_runtime_typechecks):
    with pytest.raises(ValueError, match=message):
        DraftModel(llama, vocab=vocab)


def test_a_draft_checkpoints_vocabulary_file_is_read_or_refused(tmp_path):
    assert draft_vocab(tmp_path) is None  # none written: every token
    file = tmp_path / DRAFT_VOCAB
    file.write_text("[3, 1, 2]")
    assert draft_vocab(tmp_path).tolist() == [3, 1, 2]
    for text in ("[3, 1.5]", '{"ids": [1]}', "not json"):
        file.write_text(text)
        with pytest.raises(ValueError, match=f"{DRAFT_VOCAB} .*token ids.*examples.train_draft"):
            draft_vocab(tmp_path)


def test_a_draft_of_another_vocabulary_is_refused(llama, without_runtime_typechecks):
    other = zoo.Transformer(dataclasses.replace(LLAMA, vocab_size=300), key=jax.random.key(3))
    message = r"draft model's vocabulary \(300 tokens\) is not the target's \(256 tokens\)"
    with pytest.raises(ValueError, match=message):
        Engine(llama, max_batch=1, max_len=64, speculative=DraftModel(other, k=2))
    with pytest.raises(ValueError, match="DraftModel k must be an int >= 1"):
        DraftModel(llama, k=0)


def test_a_draft_tokenizer_must_be_the_targets():
    from tests.reference.runner import smollm2_gguf

    tokenizer = zoo.load_tokenizer(smollm2_gguf())
    check_tokenizers(tokenizer, tokenizer)
    named = set(tokenizer.named_tokens.values())
    fewer = {t: i for t, i in tokenizer.special_tokens.items() if t in named}
    other = dataclasses.replace(tokenizer, special_tokens=fewer, source="other.gguf")
    with pytest.raises(ValueError, match=r"draft's tokenizer \(other.gguf, .* not the target's"):
        check_tokenizers(tokenizer, other)


def test_a_truncated_draft_is_the_targets_first_layers(llama, without_runtime_typechecks):
    target = llama.with_policy(storage="unrolled")
    draft = truncated_draft(target, 1)
    assert draft.config.n_layers == 1 and len(draft.stacks[0].blocks) == 1
    first = target.stacks[0].blocks[0], target.embed, target.final_norm
    ours = draft.stacks[0].blocks[0], draft.embed, draft.final_norm
    # The target's own arrays, not copies.
    assert all(a is b for a, b in zip(jax.tree.leaves(ours), jax.tree.leaves(first), strict=True))
    proposer = DraftModel(draft, k=2, adaptive=False)
    engine = Engine(target, max_batch=1, max_len=64, speculative=proposer, warm_up=False)
    request = engine.submit([5, 6, 7], max_new_tokens=6)
    engine.run()
    assert request.tokens == alone(llama, [5, 6, 7], 6) and request.drafted > 0
    for bad in (0, 2, True):
        with pytest.raises(ValueError, match=r"n_layers must be an int in \[1, 1\]"):
            truncated_draft(target, bad)
    # A stacked target (the CPU's decode storage) gives a stacked draft: its first layers' slices.
    stacked = truncated_draft(llama, 1)
    assert stacked.stacks[0].stacked and stacked.stacks[0].repeats == 1
    for a, b in zip(jax.tree.leaves(stacked.stacks[0].blocks),
                    jax.tree.leaves(llama.stacks[0].blocks), strict=True):  # fmt: skip
        np.testing.assert_array_equal(a, b[:1])


def test_acceptance_counts_judged_drafts_and_forgets_old_ones():
    """A verification that keeps `a` of `k` drafts is `a` kept trials and, when a < k, one
    rejected trial (drafts after a rejection are never judged); every trial decays the older
    ones by DECAY."""
    rate = Acceptance()
    rate.observe_verification(4, 4)  # four kept, no rejection
    kept, tried = PRIOR_KEPT, PRIOR_TRIED
    for _ in range(4):
        kept, tried = DECAY * kept + 1, DECAY * tried + 1
    assert (rate.kept, rate.tried) == pytest.approx((kept, tried))
    rate.observe_verification(4, 1)  # one kept, then a rejection: two trials
    kept, tried = DECAY * (DECAY * kept + 1), DECAY * (DECAY * tried + 1) + 1
    assert (rate.kept, rate.tried) == pytest.approx((kept, tried))
    for _ in range(60):  # a long run of rejections outweighs all of it
        rate.observe_verification(4, 0)
    assert rate.rate < 0.01


@pytest.mark.parametrize(
    "rates, verify_cost, drafts",
    [
        # zoo.math: tokens per step (1 - a^(k+1)) / (1 - a) over the verification's cost; a
        # cost that does not grow with k (prompt lookup) makes the most drafts the best.
        ([0.9], lambda k: 2.0, 6),  # 5.2 tokens for 2 steps' time
        ([0.3], lambda k: 2.0, 0),  # at most 1.43 tokens
        ([0.0], lambda k: 1.0, 0),  # nothing kept: a plain step is as good, never better
        ([0.9, 0.0], lambda k: 2.0, 6),  # mean of 2.6x and 0.5x at k = 6
        ([0.6, 0.0], lambda k: 2.0, 0),  # mean of 1.22x and 0.5x at k = 6
        ([], lambda k: 1.0, 0),
        # A draft model's forwards: 1.1 + 0.1 k steps. At 0.4: 1.40 / 1.2 = 1.167 (k = 1),
        # 1.56 / 1.3 = 1.200 (k = 2), 1.624 / 1.4 = 1.160 (k = 3), falling after.
        ([0.4], lambda k: 1.1 + 0.1 * k, 2),
        # At 0.8 the gain grows to k = 6: 3.951 / 1.7 = 2.324 against 3.689 / 1.6 = 2.306.
        ([0.8], lambda k: 1.1 + 0.1 * k, 6),
        ([0.1], lambda k: 1.1 + 0.1 * k, 0),  # 1.1 / 1.2
    ],
)
def test_drafts_that_pay_maximise_the_mean_expected_speedup(rates, verify_cost, drafts):
    assert drafts_that_pay(rates, 6, verify_cost) == drafts


class FixedCosts(StepCosts):
    """A verification step of k drafts per row costs `cost` plain ones (or `cost[k]`), whatever
    the timings (the test's decisions then depend on acceptance alone)."""

    def __init__(self, cost: float | dict[int, float] = 2.0):
        super().__init__(verify=())
        self.cost = cost

    def add(self, kind, seconds, *, first_may_compile=True):
        pass

    def unmeasured(self):
        return None

    def verify_cost(self, k=None):
        return self.cost if isinstance(self.cost, float) else self.cost[k]


class TurnsWrong(Proposer):
    """The greedy continuation while the sequence is shorter than `until`, then always-wrong
    drafts: the acceptance rate goes from 1 to 0 mid-request."""

    k: int
    answer: tuple
    until: int
    adaptive = True

    def propose(self, tokens, k):
        drafts = np.array(self.answer[len(tokens) : len(tokens) + k], np.int64)
        return drafts if len(tokens) < self.until else (drafts + 1) % 256


def test_a_draft_models_first_request_lowers_nothing(llama):
    """The draft's programs compile at the warm-up on the state every later step has (committed
    to its device, as a program's outputs are): the first request lowers nothing. (An
    uncommitted first state was another lowering: the first request compiled the draft's decode
    programs again.) A configuration no other test runs, so nothing was compiled before."""
    draft = DraftModel(llama, k=3, adaptive=False)
    engine = Engine(llama, **dict(SHAPE, max_len=72), speculative=draft)

    def run():
        engine.submit(prompts([5], seed=9)[0], max_new_tokens=6)
        engine.run()

    assert _lowerings(run) == 0


def test_adaptive_speculation_follows_the_acceptance_rate(llama):
    """Good drafts turn verification on, then wrong drafts turn it off (one token per row
    per step again, with the host one step behind); the tokens stay greedy's and nothing
    compiles after the start."""
    prompt, new = prompts([6], seed=5)[0], 40
    expected = alone(llama, prompt, new)
    until = len(prompt) + 16
    proposer = TurnsWrong(k=4, answer=tuple(prompt + expected), until=until)
    kwargs = dict(SHAPE, speculative=proposer)
    Engine(llama, **kwargs)  # compiles the four programs (or finds them compiled)
    before = dict(TRACES)
    engine = Engine(llama, **kwargs)
    engine.costs = FixedCosts()
    drafted = []  # (tokens so far, drafts verified so far) at each streamed piece
    request = engine.submit(
        prompt,
        max_new_tokens=new,
        on_tokens=lambda t: drafted.append((len(request.tokens) + len(t), request.drafted)),
    )
    engine.run()
    assert request.tokens == expected
    early = [d for n, d in drafted if n + len(prompt) <= until]
    assert early[-1] > 0 and request.accepted > 0  # verified while the drafts were right
    # Once wrong: each rejection lowers the rate; a few verifications later it stays off.
    late = [d for n, d in drafted if n >= new - 10]
    assert len(set(late)) == 1
    assert dict(TRACES) == before


def test_adaptive_draft_rows_verify_only_while_their_drafts_are_kept(llama):
    """A draft that is always wrong (the target with its final norm negated: its argmax is the
    target's argmin) is verified only until its rejections bring the expected speedup under 1
    (as many verifications as the prior allows, counted here with zoo.math's rule), then never:
    each later step decodes one token, the draft's guesses beside those steps keep the rate
    down, and once it is below GIVE_UP the request stops drafting (no draft forwards). The
    target as its own draft, held to plain steps until its guesses (one draft forward beside
    each plain step, its cache kept level with the target's) lift the rate past a high
    verification cost, then verifies and has every draft kept, 2 per step where 2 drafts cost
    least for what they give (the draft's loop bounded at runtime). Greedy tokens; nothing
    compiles after the first engine."""
    prompt, new, k = prompts([7], seed=6)[0], 24, 4
    expected = alone(llama, prompt, new)
    wrong = eqx.tree_at(lambda m: m.final_norm.scale, llama, -llama.final_norm.scale)
    kwargs = dict(max_batch=2, max_len=64, page_size=8, chunk=16)
    Engine(llama, speculative=DraftModel(wrong, k=k), **kwargs)  # compiles every program
    before = dict(TRACES), dict(DRAFT_TRACES)
    rate, verifications = Acceptance(), 0
    while drafts_that_pay([rate.rate], k, lambda _: 2.0):
        rate.observe_verification(k, 0)
        verifications += 1
    # For the right draft 2 drafts pay best at any rate: (1 + r + r^2) / 2.5 > (k + 1) / 4.5.
    for draft, cost in ((wrong, 2.0), (llama, {1: 4.5, 2: 2.5, 3: 4.5, 4: 4.5})):
        engine = Engine(llama, speculative=DraftModel(draft, k=k), **kwargs)
        engine.time_steps(2)  # timed at warm-up and now, the draft's work beside each step
        # The plain step, and verifications of 1 and k drafts (a draft model's forwards).
        assert {kind: len(t) for kind, t in engine.costs.times.items()} == dict.fromkeys(
            ("plain", 1, k), WARM_UP_TIMINGS + 2
        )
        engine.costs = FixedCosts(cost)
        pieces = []  # tokens per step
        request = engine.submit(prompt, max_new_tokens=new, on_tokens=pieces.append)
        engine.run()
        assert request.tokens == expected
        forwards = sum(r.decode_rows > 0 for r in engine.records)
        if draft is wrong:
            assert request.drafted == k * verifications and request.accepted == 0
            assert forwards == new - 1  # one token per target forward
            assert request.draft_tokens == 0  # gave up
        else:
            assert request.accepted == request.drafted > 0  # every draft kept once verifying
            assert max(map(len, pieces)) == 3  # 2 drafts kept and the target's token
            assert forwards > request.drafted / 2  # some plain steps came first
            assert request.draft_tokens == k
    assert (dict(TRACES), dict(DRAFT_TRACES)) == before


def test_step_costs_interpolate_a_verification_between_the_draft_counts_timed():
    """A draft model's verification is timed at 1 and K drafts; a count between costs the
    straight line between them (its draft forwards), in plain steps (medians)."""
    costs = StepCosts(verify=(1, 4))
    assert costs.unmeasured() == "plain" and costs.verify_cost(2) == 1.0  # nothing timed yet
    for kind, seconds in (("plain", [0.010, 0.010, 0.013]), (1, [0.012]), (4, [0.018, 0.017])):
        for s in seconds:
            costs.add(kind, s, first_may_compile=False)
    assert costs.unmeasured() is None
    assert costs.verify_cost(1) == pytest.approx(1.2)
    assert costs.verify_cost(2) == pytest.approx((0.012 + (0.0175 - 0.012) / 3) / 0.010)
    assert costs.verify_cost() == pytest.approx(1.75)  # the most drafts timed
