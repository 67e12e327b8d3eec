"""The serving engine: continuous batching over a paged KV cache gives every request the tokens
it would get alone; nothing recompiles after the start; pages come and go with the requests;
prefixes are shared; bad input is refused at submit without disturbing what is in flight."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import infer
import zoo
from infer.engine import TRACES, Engine
from layers.kernels import Flash, PallasDecodeKernel

LLAMA = zoo.preset("tiny-llama", n_layers=2, max_seq_len=256)


@pytest.fixture(scope="module")
def llama():
    return zoo.Transformer(LLAMA, key=jax.random.key(0))


_forward = eqx.filter_jit(lambda model, tokens: model(tokens))


def alone(model, prompt, n):
    """Greedy continuation of one prompt by full forwards (the specification): each new token
    is the argmax at the row's last token. The row is right-padded to a multiple of 64 tokens
    (under the causal mask padding changes no earlier position), so a few compiled forwards
    serve every call instead of one eager forward per length."""
    width = min(-(-(len(prompt) + n) // 64) * 64, model.config.max_seq_len)
    tokens = list(prompt)
    for _ in range(n):
        row = jnp.asarray([tokens + [0] * (width - len(tokens))])
        tokens.append(int(jnp.argmax(_forward(model, row)[0, len(tokens) - 1])))
    return tokens[len(prompt) :]


def prompts(lengths, seed=0):
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 256, n).tolist() for n in lengths]


# Learned positions (GPT-2) and an MoE model of two stacks (a leading dense layer, then MoE
# layers) on stacked storage; Llama on unrolled storage is test_paged_decode_kernel's model.
@pytest.mark.parametrize(
    "name, changes",
    [("tiny-gpt2", {}), ("tiny-moe", {"first_dense_layers": 1, "moe_every": 1})],
)
def test_engine_equals_each_request_alone(name, changes):
    config = zoo.preset(name, n_layers=3, **changes)
    model = zoo.Transformer(config, key=jax.random.key(1))
    engine = Engine(model, max_batch=3, max_len=96, page_size=8, chunk=16)
    # More requests than rows, prompts shorter and longer than a chunk, different budgets.
    cases = list(zip(prompts([5, 37, 16, 3, 50, 21]), [6, 3, 9, 1, 4, 7], strict=True))
    requests = [engine.submit(p, max_new_tokens=n) for p, n in cases]
    engine.run()
    for (prompt, n), request in zip(cases, requests, strict=True):
        assert request.done and request.tokens == alone(model, prompt, n)
    assert engine.pool.in_use == 0 and engine.pool.reserved == 0


def test_nothing_compiles_after_the_start_for_any_prompt_length(llama):
    engine = Engine(llama, max_batch=2, max_len=200, page_size=16, chunk=32)
    before = dict(TRACES)
    for length in (1, 7, 31, 32, 33, 64, 150, 199):
        engine.submit(prompts([length], seed=length)[0], max_new_tokens=200 - length)
    engine.submit([1, 2, 3], max_new_tokens=5, sampler=infer.TopP(0.8, temperature=0.7))
    engine.submit([4, 5], max_new_tokens=3, sampler=infer.Temperature(1.3), stop_tokens=[7])
    engine.run()
    assert dict(TRACES) == before


def test_every_kernel_serves_every_prompt_length():
    model = zoo.Transformer(LLAMA, key=jax.random.key(0))
    flash = model.with_policy(attention=Flash())
    engine = Engine(flash, max_batch=2, max_len=128, page_size=16, chunk=32)
    cases = prompts([5, 37, 70])
    requests = [engine.submit(p, max_new_tokens=4) for p in cases]
    engine.run()
    naive = model.with_policy(attention="naive")
    for prompt, request in zip(cases, requests, strict=True):
        assert request.tokens == alone(naive, prompt, 4)


def test_paged_decode_kernel_equals_the_gather_path(llama):
    cases = prompts([9, 30, 17])
    results = []
    for kernel in (None, PallasDecodeKernel(keys_per_block=16, interpret=True)):
        engine = Engine(llama.unstacked(), max_batch=4, max_len=64, page_size=16, chunk=16,
                        decode_kernel=kernel)  # fmt: skip
        requests = [engine.submit(p, max_new_tokens=5) for p in cases]
        engine.run()
        results.append([r.tokens for r in requests])
    assert results[0] == results[1] == [alone(llama, p, 5) for p in cases]


def test_the_paged_decode_kernel_needs_unrolled_layers(llama):
    with pytest.raises(ValueError, match=r"model\.unstacked\(\)"):
        Engine(llama, max_batch=1, max_len=64, chunk=16, decode_kernel=PallasDecodeKernel())


def test_pages_follow_the_tokens_and_come_back(llama):
    engine = Engine(llama, max_batch=2, max_len=128, page_size=8, chunk=32, prefix_sharing=False)
    request = engine.submit(list(range(1, 20)), max_new_tokens=6)
    engine.step()  # admits and prefills 19 tokens: 3 pages of 8
    assert engine.pool.in_use == 3
    engine.run()
    assert engine.pool.in_use == 0 and len(request.tokens) == 6
    assert engine.kv_bytes_in_use() == 0 < engine.contiguous_kv_bytes()


def test_an_exhausted_pool_makes_requests_wait(llama):
    # 4 usable pages of 8 tokens: one request of 12 + 12 tokens (3 pages) at a time.
    engine = Engine(llama, max_batch=3, max_len=64, page_size=8, n_pages=5, chunk=16)
    cases = prompts([12, 12, 12])
    requests = [engine.submit(p, max_new_tokens=12) for p in cases]
    engine.step()
    assert [r.row >= 0 for r in requests] == [True, False, False]
    engine.run()
    for prompt, request in zip(cases, requests, strict=True):
        assert request.tokens == alone(llama, prompt, 12)
    with pytest.raises(ValueError, match="needs 8 pages of 8 tokens but the pool holds 4"):
        engine.submit(list(range(1, 40)), max_new_tokens=25)


def test_shared_prefixes_are_prefilled_once(llama):
    system = prompts([40], seed=3)[0]
    questions = prompts([5, 9, 3], seed=4)
    engine = Engine(llama, max_batch=2, max_len=96, page_size=8, chunk=16)
    first = engine.submit(system + questions[0], max_new_tokens=4)
    engine.run()
    computed = engine.prefill_tokens
    later = [engine.submit(system + q, max_new_tokens=4) for q in questions[1:]]
    engine.run()
    # 40 system tokens = 5 full pages, reused by both later requests.
    assert [r.reused_tokens for r in later] == [40, 40]
    assert engine.prefill_tokens - computed == sum(len(q) for q in questions[1:])
    for question, request in zip(questions, [first, *later], strict=True):
        assert request.tokens == alone(llama, system + question, 4)


def test_requests_submitted_while_running_join(llama):
    engine = Engine(llama, max_batch=2, max_len=64, chunk=16)
    joined = []

    def submit_another(tokens):
        if not joined:
            joined.append(engine.submit([9, 8, 7], max_new_tokens=3))

    first = engine.submit([1, 2, 3], max_new_tokens=5, on_tokens=submit_another)
    engine.run()
    assert first.done and joined[0].done
    assert joined[0].tokens == alone(llama, [9, 8, 7], 3)


def test_a_failing_request_does_not_take_the_others_down(llama):
    engine = Engine(llama, max_batch=2, max_len=64, chunk=16)

    def broken(tokens):
        raise RuntimeError("listener failed")

    bad = engine.submit([1, 2, 3], max_new_tokens=5, on_tokens=broken)
    good = engine.submit([4, 5, 6], max_new_tokens=5)
    engine.run()
    assert isinstance(bad.error, RuntimeError) and len(bad.tokens) == 1
    assert good.tokens == alone(llama, [4, 5, 6], 5)


def test_samplers_differ_per_row_in_one_batch(llama):
    engine = Engine(llama, max_batch=2, max_len=64, chunk=16, key=jax.random.key(5))
    top1 = engine.submit([1, 2, 3], max_new_tokens=6, sampler=infer.TopK(1, temperature=2.0))
    hot = engine.submit([1, 2, 3], max_new_tokens=6, sampler=infer.Temperature(50.0))
    engine.run()
    assert top1.tokens == alone(llama, [1, 2, 3], 6)  # top-1 is greedy at any temperature
    assert hot.tokens != top1.tokens  # a near-uniform draw (seeded) leaves the greedy path


@pytest.mark.parametrize(
    "prompt, kwargs, message",
    [
        ([], {}, "prompt 0 is empty"),
        ([1, 300], {}, r"token id 300 outside the vocabulary \[0, 256\)"),
        ([1.5, 2.0], {}, "integer token ids"),
        ([1, 2], {"max_new_tokens": 0}, "max_new_tokens must be a positive int"),
        (list(range(60)), {}, r"the prompt \(60 tokens\) \+ max_new_tokens \(8\) = 68 exceeds "),
        ([1, 2], {"stop_tokens": [999]}, "stop_tokens holds token id 999"),
    ],
)
def test_bad_requests_are_refused_at_submit(
    llama, prompt, kwargs, message, without_runtime_typechecks
):
    engine = Engine(llama, max_batch=1, max_len=64, chunk=16)
    running = engine.submit([1, 2, 3], max_new_tokens=3)
    with pytest.raises(ValueError, match=message):
        engine.submit(prompt, **{"max_new_tokens": 8, **kwargs})
    engine.run()
    assert running.tokens == alone(llama, [1, 2, 3], 3)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"max_batch": 0}, "max_batch must be a positive int"),
        ({"max_len": 300}, r"Engine max_len \(300 tokens\) exceeds Config.max_seq_len=256"),
        ({"page_size": 12}, "page_size must be a power of two dividing 64"),
        ({"chunk": 24}, "chunk must be a multiple of 16"),
        ({"prefill_rows": 3}, "prefill_rows=3 exceeds max_batch=2"),
    ],
)
def test_bad_engines_are_refused(llama, kwargs, message):
    with pytest.raises(ValueError, match=message):
        Engine(llama, **{"max_batch": 2, "max_len": 64, **kwargs})
