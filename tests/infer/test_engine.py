"""The serving engine: continuous batching over a paged KV cache, decode rows and prompt chunks in
one forward per step, gives every request the tokens it would get alone (every family's tiny
config unrolled, and stacked where its stacks differ); nothing recompiles after the start; pages
come and go with the requests, and a dry pool preempts the youngest request without losing a
token; prefixes are shared; bad input is refused at submit without disturbing what is in
flight."""

import collections
import concurrent.futures

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import infer
import zoo
from infer.compiling import Compile, Hold, finish_compiles
from infer.engine import STEP_TOKENS, TRACES, Engine, prompt_part
from layers.kernels import PallasDecodeKernel

LLAMA = zoo.preset("tiny-llama", n_layers=2, max_seq_len=256)


@pytest.fixture(scope="module")
def llama():
    return zoo.Transformer(LLAMA, key=jax.random.key(0))


# One engine shape for the tests on `llama` whose property does not depend on it: their two
# programs compile once per module, not once per test.
SHAPE = dict(max_batch=2, max_len=96, page_size=8, chunk=16)


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


# Every family's distinguishing features, tiny: learned positions (GPT-2), GQA + rope (Llama,
# Phi-3's shape), q/k/v biases (Qwen2), q/k norms (Qwen3), a uniform window kept as rings
# (Mistral), alternating windows with score and logit soft-capping and sandwich norms
# (Gemma 2), a 2-local-1-global pattern with a local rope theta (Gemma 3), experts (Mixtral),
# q/k norms and a leading dense layer before experts (Qwen3-MoE), shared experts (DeepSeek-MoE),
# latent attention with sigmoid routing (DeepSeek-V3).
_GEMMA = dict(
    norm_plus_one=True, mlp="geglu", sandwich_norm=True, embed_scale=True, n_heads=4, head_dim=16,
)  # fmt: skip
FAMILIES = {
    "gpt2": zoo.preset("tiny-gpt2"),
    "llama": zoo.preset("tiny-llama"),
    "qwen2": zoo.preset("tiny-llama", qkv_bias=True),
    "qwen3": zoo.preset("tiny-llama", qk_norm=True, head_dim=8),
    "mistral": zoo.preset("tiny-llama", sliding_window=6),
    "gemma2": zoo.preset(
        "tiny-llama", **_GEMMA, n_layers=3, query_scale=10.0, attn_softcap=2.0, final_softcap=4.0,
        sliding_window=5, layer_types=("sliding", "full", "sliding"),
    ),
    "gemma3": zoo.preset(
        "tiny-llama", **_GEMMA, n_layers=3, n_kv_heads=1, qk_norm=True, sliding_window=6,
        layer_types=("sliding", "sliding", "full"), local_rope_theta=50.0,
    ),
    "mixtral": zoo.preset("tiny-moe"),
    "qwen3-moe": zoo.preset("tiny-moe", n_layers=3, qk_norm=True, first_dense_layers=1),
    "deepseek-moe": zoo.preset("tiny-deepseek-moe"),
    "deepseek-v3": zoo.preset("tiny-deepseek-v3"),
}  # fmt: skip
# Stacked storage runs a family's layers as stacks of a period of blocks (zoo/stack.py), so what
# it adds per family is the stacks' structure and the caches they hold: one plain stack
# (llama), rings (mistral), window patterns (gemma2, gemma3), dense and MoE stacks (qwen3-moe,
# deepseek-moe), latent caches (deepseek-v3). The other families' features live inside the one
# block of a one-block stack, the path llama's stacked case runs: they run unrolled only.
STACKED = ("llama", "mistral", "gemma2", "gemma3", "qwen3-moe", "deepseek-moe", "deepseek-v3")


@pytest.mark.parametrize(
    ("family", "storage"),
    [(family, "unrolled") for family in FAMILIES] + [(family, "stacked") for family in STACKED],
)
def test_engine_equals_each_request_alone_on_every_family(family, storage):
    """More requests than rows, prompts shorter and longer than a chunk, different budgets:
    every request gets the greedy tokens of its own full forwards (the naive kernel)."""
    config = FAMILIES[family]
    policy = zoo.Policy(attention="naive", storage=storage)
    model = zoo.Transformer(config, policy=policy, key=jax.random.key(1))
    # warm_up=False: only the step shapes these requests use compile (not the 8-chunk one).
    engine = Engine(model, max_batch=2, max_len=64, page_size=8, chunk=16, warm_up=False)
    cases = list(zip(prompts([5, 37, 3, 20]), [6, 3, 1, 7], strict=True))
    requests = [engine.submit(p, max_new_tokens=n) for p, n in cases]
    engine.run()
    for (prompt, n), request in zip(cases, requests, strict=True):
        assert request.done and request.tokens == alone(model, prompt, n)
    assert engine.pool.in_use == 0


def test_nothing_compiles_after_the_start_for_any_prompt_length(llama):
    engine = Engine(llama, **SHAPE)
    before = dict(TRACES)
    for length in (1, 7, 15, 16, 17, 32, 50, 95):  # around chunks of 16, up to max_len - 1
        engine.submit(prompts([length], seed=length)[0], max_new_tokens=96 - length)
    engine.submit([1, 2, 3], max_new_tokens=5, sampler=infer.TopP(0.8, temperature=0.7))
    engine.submit([4, 5], max_new_tokens=3, sampler=infer.Temperature(1.3), stop_tokens=[7])
    engine.run()
    assert dict(TRACES) == before


def test_the_pallas_decode_kernel_equals_the_xla_path(llama):
    """The policy's paged decode kernel: the Pallas kernel (interpreted on CPU) gives the same
    tokens as the XLA path and the specification; it reads one layer's pool, so a stacked model
    is refused when the step is built."""
    cases = prompts([9, 30, 17])
    unrolled = llama.with_policy(storage="unrolled")
    pallas = unrolled.with_policy(
        decode_kernel=PallasDecodeKernel(keys_per_block=16, interpret=True)
    )
    results = []
    for model in (unrolled, pallas):
        # warm_up=False: only the step shapes these requests use compile (interpreted Pallas).
        engine = Engine(model, max_batch=4, max_len=64, page_size=16, chunk=16, warm_up=False)
        requests = [engine.submit(p, max_new_tokens=5) for p in cases]
        engine.run()
        results.append([r.tokens for r in requests])
    assert results[0] == results[1] == [alone(llama, p, 5) for p in cases]
    stacked = llama.with_policy(decode_kernel=PallasDecodeKernel(interpret=True))
    with pytest.raises(ValueError, match="storage='unrolled'"):
        Engine(stacked, max_batch=1, max_len=64, chunk=16)


def test_a_step_takes_the_waiting_prompts_chunks_its_budget_holds(llama):
    """A budget of 3 decode rows + 4 chunks of 8: the prompt part comes in 1 or 4 chunks. Five
    chunks wait: the oldest prompt's 3 and the next one's share step 0's part of 4; the third
    prompt's chunk rides along with those two rows' decoding in step 1. Every request gets its
    tokens alone, and nothing compiles after the start."""
    engine = Engine(llama, max_batch=3, max_len=64, page_size=8, chunk=8, token_budget=3 + 32)
    assert engine.prompt_shapes == (1, 4)
    finish_compiles()  # the 4-chunk programs, made ahead
    before = dict(TRACES)
    cases = prompts([20, 5, 3], seed=9)
    requests = [engine.submit(p, max_new_tokens=4) for p in cases]
    engine.run()
    first, second = engine.records[:2]
    assert (first.chunks, first.prompt_tokens, first.shape, first.decode_rows) == (4, 25, 4, 0)
    assert (second.chunks, second.prompt_tokens, second.shape, second.decode_rows) == (1, 3, 1, 2)
    assert [r.tokens for r in requests] == [alone(llama, p, 4) for p in cases]
    assert dict(TRACES) == before


def test_with_no_row_decoding_a_prompt_goes_in_the_smallest_shape_that_holds_it(llama):
    """Shapes of 1 or 4 chunks of 8. The first prompt's 3 chunks find no row decoding: one step
    of the 4-chunk shape takes them all (the largest shape they fill, 1, would take three steps).
    The second prompt's 3 chunks come while the first decodes: one chunk a step beside it, so
    each step also advances the decoding row. Every request gets its tokens alone."""
    engine = Engine(llama, max_batch=2, max_len=64, page_size=8, chunk=8, token_budget=2 + 32)
    assert engine.prompt_shapes == (1, 4)
    finish_compiles()  # the 4-chunk programs, made ahead
    cases = prompts([20, 20], seed=4)
    first = engine.submit(cases[0], max_new_tokens=8)
    engine.step()
    engine.step()
    second = engine.submit(cases[1], max_new_tokens=3)
    engine.run()
    records = [(r.decode_rows, r.chunks, r.prompt_tokens, r.shape) for r in engine.records]
    assert records[0] == (0, 3, 20, 4)
    assert [r for r in records if r[1]][1:] == [(1, 1, 8, 1), (1, 1, 8, 1), (1, 1, 4, 1)]
    assert first.tokens == alone(llama, cases[0], 8)
    assert second.tokens == alone(llama, cases[1], 3)


def test_no_step_waits_for_a_program_made_ahead(llama, monkeypatch):
    """Shapes of 1 or 4 chunks of 8, the 4-chunk programs made ahead. While they are not
    compiled (a hold keeps the compiles made ahead from starting; hurrying them does nothing
    here), a 20-token prompt goes in 1-chunk steps instead of waiting for them, and gets the
    tokens it gets alone; once they are compiled, the next prompt takes one 4-chunk step."""
    shape = dict(max_batch=2, max_len=40, page_size=8, chunk=8)  # this test's own programs
    cases = prompts([20, 20], seed=5)
    with monkeypatch.context() as patch, Hold():
        patch.setattr(Compile, "hurry", lambda self: None)
        engine = Engine(llama, token_budget=2 + 32, **shape)
        assert engine.prompt_shapes == (1, 4)
        first = engine.submit(cases[0], max_new_tokens=3)
        engine.run()
    assert [(r.chunks, r.shape) for r in engine.records if r.chunks] == [(1, 1)] * 3
    finish_compiles()
    second = engine.submit(cases[1], max_new_tokens=3)
    engine.run()
    assert [(r.chunks, r.shape) for r in engine.records if r.chunks][3:] == [(3, 4)]
    assert first.tokens == alone(llama, cases[0], 3)
    assert second.tokens == alone(llama, cases[1], 3)


def test_the_prompt_part_first_prompts_take_compiles_at_once_not_ahead(llama):
    """A 20-token prompt announced at the start (`first_prompts`, as `generate` does) wants the
    4-chunk part in its first step: those programs compile while a hold keeps every compile
    made ahead from starting. Bad lengths are refused."""
    shape = dict(max_batch=2, max_len=24, page_size=8, chunk=8)  # this test's own programs
    with Hold():
        engine = Engine(llama, token_budget=2 + 32, first_prompts=[20], **shape)
        jobs = engine._shape_compiles(4)
        done, _ = concurrent.futures.wait([job.future for job in jobs], timeout=300)
    assert engine.prompt_shapes == (1, 4) and jobs and len(done) == len(jobs)
    for bad in ([0], [-3], [True]):
        with pytest.raises(ValueError, match="first_prompts must be prompt lengths"):
            Engine(llama, first_prompts=bad, warm_up=False, **shape)


def test_an_idle_engines_prompt_part_pads_only_where_it_saves_steps():
    """Shapes of 1, 4 or 16 chunks of 16, a step worth STEP_TOKENS = 32 prompt tokens: with no
    row decoding, 2 chunks pad to 4 (32 tokens for 1 step) and 3 to 4 (16 for 2), 5 do not pad
    to 16 (176 tokens for 1 step), 12 do (64 for 2); beside a decoding row, never."""
    shapes, part = (1, 4, 16), lambda w, d=False: prompt_part(w, shapes, 16, decoding=d)
    assert STEP_TOKENS == 32
    assert [part(w) for w in (0, 1, 2, 3, 4, 5, 8, 12, 16, 40)] == [0, 1, 4, 4, 4, 4, 4, 16, 16, 16]
    assert [part(w, True) for w in (2, 3, 5, 12)] == [1, 1, 4, 4]


def test_pages_follow_the_tokens_and_come_back(llama):
    engine = Engine(llama, **SHAPE, prefix_sharing=False)
    finish_compiles()  # the larger prompt parts' programs, made ahead
    request = engine.submit(list(range(1, 20)), max_new_tokens=6)
    engine.step()  # admits and prefills its 19 tokens (2 chunks of 16): 3 pages of 8
    assert engine.pool.in_use == 3
    engine.run()
    assert engine.pool.in_use == 0 and len(request.tokens) == 6
    assert engine.kv_bytes_in_use() == 0 < engine.contiguous_kv_bytes()


def test_a_dry_pool_preempts_the_youngest_and_loses_no_token(llama):
    """6 usable pages of 8 tokens for three requests of 12 + 20 tokens (4 pages each): all three
    start, the pool runs dry mid-decode, the youngest running request gives its pages back and
    is recomputed later (its prompt and the tokens it had), and every request still gets
    exactly its greedy tokens, the oldest never preempted."""
    engine = Engine(llama, max_batch=3, max_len=64, page_size=8, n_pages=7, chunk=16, warm_up=False)
    cases = prompts([12, 12, 12])
    streamed = [[] for _ in cases]
    requests = [
        engine.submit(p, max_new_tokens=20, on_tokens=streamed[i].extend)
        for i, p in enumerate(cases)
    ]
    engine.step()
    assert [r.row >= 0 for r in requests] == [True, True, True]
    engine.run()
    assert requests[0].preemptions == 0 and sum(r.preemptions for r in requests) > 0
    for prompt, request, got in zip(cases, requests, streamed, strict=True):
        assert request.tokens == got == alone(llama, prompt, 20)
    assert engine.pool.in_use == 0
    with pytest.raises(ValueError, match="needs 8 pages of 8 tokens but the pool holds 6"):
        engine.submit(list(range(1, 40)), max_new_tokens=25)


def test_shared_prefixes_are_prefilled_once(llama):
    system = prompts([40], seed=3)[0]
    questions = prompts([5, 9, 3], seed=4)
    engine = Engine(llama, **SHAPE)
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
    engine = Engine(llama, **SHAPE)
    joined = []

    def submit_another(tokens):
        if not joined:
            joined.append(engine.submit([9, 8, 7], max_new_tokens=3))

    first = engine.submit([1, 2, 3], max_new_tokens=5, on_tokens=submit_another)
    engine.run()
    assert first.done and joined[0].done
    assert joined[0].tokens == alone(llama, [9, 8, 7], 3)


def test_a_failing_request_does_not_take_the_others_down(llama):
    engine = Engine(llama, **SHAPE)

    def broken(tokens):
        raise RuntimeError("listener failed")

    bad = engine.submit([1, 2, 3], max_new_tokens=5, on_tokens=broken)
    good = engine.submit([4, 5, 6], max_new_tokens=5)
    engine.run()
    assert isinstance(bad.error, RuntimeError) and len(bad.tokens) == 1
    assert good.tokens == alone(llama, [4, 5, 6], 5)


def test_samplers_differ_per_row_in_one_batch(llama):
    engine = Engine(llama, **SHAPE, key=jax.random.key(5))
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
        (list(range(90)), {}, r"the prompt \(90 tokens\) \+ max_new_tokens \(8\) = 98 exceeds "),
        ([1, 2], {"stop_tokens": [999]}, "stop_tokens holds token id 999"),
        ([1, 2], {"stop_tokens": "ab"}, "stop_tokens must be token ids, got the string"),
        ([1, 2], {"stop_tokens": list(range(17))}, "17 stop tokens, but .* max_stop_tokens=16"),
        ([1, 2], {"max_new_tokens": True}, "max_new_tokens must be a positive int, got True"),
        ([1, 2], {"max_new_tokens": 2.0}, "max_new_tokens must be a positive int, got 2.0"),
        ([1, 2], {"sampler": "greedy"}, "sampler must be an infer sampler"),
        ([1, 2], {"on_tokens": 3}, "on_tokens must be callable"),
    ],
)
def test_bad_requests_are_refused_at_submit(
    llama, prompt, kwargs, message, without_runtime_typechecks
):
    engine = Engine(llama, **SHAPE)
    running = engine.submit([1, 2, 3], max_new_tokens=3)
    with pytest.raises(ValueError, match=message):
        engine.submit(prompt, **{"max_new_tokens": 8, **kwargs})
    engine.run()
    assert running.tokens == alone(llama, [1, 2, 3], 3)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"max_batch": 0}, "max_batch must be an int >= 1, got 0"),
        ({"max_batch": 2.0}, "max_batch must be an int >= 1, got 2.0"),
        ({"max_len": 300}, r"Engine max_len \(300 tokens\) exceeds Config.max_seq_len=256"),
        ({"page_size": True}, "page_size must be an int >= 1, got True"),
        ({"chunk": 0}, "chunk must be an int >= 1, got 0"),
        ({"token_budget": 17}, "token_budget=17 leaves no room for a prompt chunk: .* 2 tokens"),
        ({"key": 3}, r"key must be a jax.random.key\(...\) \(one key, not a batch\), got 3"),
        ({"key": jax.random.split(jax.random.key(0))}, r"\(one key, not a batch\), got Array"),
    ],
)
def test_bad_engines_are_refused(llama, kwargs, message, without_runtime_typechecks):
    with pytest.raises(ValueError, match=message):
        Engine(llama, **{"max_batch": 2, "max_len": 64, **kwargs})


def test_numpy_integer_counts_are_accepted(llama):
    counts = {name: np.int64(n) for name, n in SHAPE.items()} | {"max_len": np.int32(96)}
    engine = Engine(llama, **counts)
    request = engine.submit(np.array([1, 2, 3]), max_new_tokens=np.int64(3))
    engine.run()
    assert request.tokens == alone(llama, [1, 2, 3], 3)


def test_new_weights_of_the_same_structure_compile_nothing(llama):
    """`engine.model` replaced between runs (a policy update in RL, new adapter weights): the
    next requests decode with the new weights, through the programs already compiled."""
    engine = Engine(llama, **SHAPE)
    other = zoo.Transformer(LLAMA, key=jax.random.key(42))
    before = dict(TRACES)
    engine.model = other
    request = engine.submit([1, 2, 3], max_new_tokens=4)
    engine.run()
    assert dict(TRACES) == before
    assert request.tokens == alone(other, [1, 2, 3], 4) != alone(llama, [1, 2, 3], 4)


def test_a_decode_step_uploads_one_array_and_passes_the_weights_flat(llama):
    """What the host hands the step's programs in decode-only steps: the forward gets the
    model as the flat list of leaves it flattened once (flattening the model's modules on every
    call costs the host more than a small step) and one host array, the packed plan; the
    sampling program gets nothing from the host. Everything else already lives on the device.
    New weights are flattened once, at the next step."""
    engine = Engine(llama, **SHAPE)
    calls, sampled = [], []
    compiled = engine._compiled

    def recording(plan):
        forward, sampler = compiled(plan)

        def call(*args):
            calls.append(args)
            return forward(*args)

        def sample(*args):
            sampled.append(args)
            return sampler(*args)

        return call, sample

    engine._compiled = recording
    engine.submit([1, 2, 3], max_new_tokens=8)
    engine.run()
    decode = [calls[r.step] for r in engine.records if not r.chunks]
    assert len(decode) == 7
    for weights, *rest in decode:
        assert weights is decode[0][0]  # flattened once
        assert type(weights) is list and all(isinstance(x, jax.Array) for x in weights)
        uploads = [x for x in jax.tree.leaves(rest) if not isinstance(x, jax.Array)]
        assert len(uploads) == 1 and uploads[0].dtype == np.int32 and uploads[0].ndim == 1
    assert len(sampled) == len(calls)
    assert all(isinstance(x, jax.Array) for args in sampled for x in jax.tree.leaves(args))
    engine.model = zoo.Transformer(LLAMA, key=jax.random.key(1))
    engine.submit([1, 2, 3], max_new_tokens=2)
    engine.run()
    assert calls[-1][0] is not decode[0][0]


def _lowerings(run) -> int:
    """How many programs `run()` lowered (JAX's lowering event: a program it did not have)."""
    events = []

    def listen(event, *_, **__):
        events.append(event == "/jax/core/compile/jaxpr_to_mlir_module_duration")

    jax.monitoring.register_event_duration_secs_listener(listen)
    try:
        run()
    finally:
        jax.monitoring.unregister_event_duration_listener(listen)
    return sum(events)


def test_engines_share_the_sampling_program_and_a_second_engine_compiles_nothing(llama):
    """A step is a forward per step shape and one sampling program whose shapes are the rows',
    the width's and the vocabulary's only: every shape of an engine runs the same one, and so
    does an engine of another model with the same rows and vocabulary (only its forwards are
    traced). A second engine of a configuration already started builds no program at all."""
    Engine(llama, **SHAPE)
    before = collections.Counter(TRACES)
    other = zoo.Transformer(FAMILIES["gpt2"], key=jax.random.key(0))
    assert other.config.vocab_size == LLAMA.vocab_size
    engine = Engine(other, **SHAPE)
    traced = collections.Counter(TRACES) - before
    assert traced == {"decode": 1, **{f"mixed {c}x16": 1 for c in engine.prompt_shapes}}
    assert _lowerings(lambda: Engine(other, **SHAPE)) == 0
    assert _lowerings(lambda: Engine(other, **{**SHAPE, "max_batch": 3})) > 0  # the count counts


def test_an_engine_built_while_the_last_ones_programs_compile_shares_them():
    """The warm-up lowers every program and compiles them on background threads; an engine of
    the same configuration built right after (as `generate` builds one per call) takes the same
    compiles, in flight or done, rather than compiling them again, and a step waits for its own
    program: both engines give every request its greedy tokens."""
    model = zoo.Transformer(zoo.preset("tiny-llama", n_layers=1), key=jax.random.key(7))
    shape = dict(max_batch=2, max_len=48, page_size=8, chunk=8)  # this test's own programs
    first, second = Engine(model, **shape), Engine(model, **shape)
    assert len(first._programs) == 1 + len(first.prompt_shapes) and first._samplers
    assert first._programs.keys() == second._programs.keys()
    for shape_key, future in first._programs.items():
        assert second._programs[shape_key] is future
    assert [second._samplers[w] for w in first._samplers] == list(first._samplers.values())
    cases = prompts([3, 21, 9], seed=11)
    for engine in (second, first):
        requests = [engine.submit(p, max_new_tokens=4) for p in cases]
        engine.run()
        assert [r.tokens for r in requests] == [alone(model, p, 4) for p in cases]


def test_a_request_joins_and_its_step_is_dispatched_while_the_device_is_busy(llama):
    """The host runs one step behind the device: admitting a request (its sampler's settings,
    stop tokens, budget) and dispatching the step it joins need nothing computed on the device.
    XLA:CPU runs programs in order, so a device op on the host's path would wait for a program
    dispatched before it: here ~10^11 FLOPs of products, which the host's path (milliseconds)
    must leave still running, as reading a sampler through eager ops did not."""
    engine = Engine(llama, **SHAPE)
    a = jnp.full((1024, 1024), 1e-3, jnp.float32)
    products = jax.jit(lambda a: jax.lax.fori_loop(0, 48, lambda _, x: x @ a, a))
    products(a).block_until_ready()  # compiled before the busy run
    busy = products(a)
    request = engine.submit([1, 2, 3], max_new_tokens=3, sampler=infer.TopK(2, 0.5))
    engine.step()  # admits the request and dispatches its step: reads nothing back
    assert not busy.is_ready()
    engine.run()
    assert len(request.tokens) == 3
