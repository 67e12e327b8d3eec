"""The int8 KV cache (`kv_dtype="int8"`): a tiny model's logits stay within a tolerance derived
from the int8 step sizes and the model's own sensitivity to its cached keys and values; the
engine gives each request the greedy tokens of the int8 cache alone; its pools hold the bytes
zoo.math and training.plan predict, so the same bytes hold twice the rows (more than 3x against
float32) and run them at once; nothing recompiles; unknown dtypes are refused with the
choices."""

import equinox as eqx
import jax
import jax.numpy as jnp
import pytest

import infer
import shard
import zoo
from infer.engine import TRACES, Engine
from layers import paged_cache
from layers.kernels.paged.int8 import quantize
from tests.infer.test_engine import prompts
from tests.training.test_plan import bytes_per_device
from training.plan import plan
from zoo.math import HARDWARE, kv_cache_bytes_per_token

LLAMA = zoo.preset("tiny-llama", n_layers=2, max_seq_len=128)
# Multi-head latent attention without experts: a flipped top-k routing choice is a jump no
# first-order tolerance covers (an MoE model's int8 logits may differ by a routing decision).
MLA = zoo.preset("tiny-deepseek-v3", n_experts=0, n_experts_per_token=0, n_shared_experts=0)
GEMMA2 = zoo.preset(
    "tiny-llama", norm_plus_one=True, mlp="geglu", sandwich_norm=True, n_layers=3,
    attn_softcap=2.0, final_softcap=4.0, sliding_window=5,
    layer_types=("sliding", "full", "sliding"),
)  # fmt: skip
UNROLLED = zoo.Policy(storage="unrolled")
# Layers in a Python loop inside the caller's trace, so `writes_with_noise` can collect what each
# layer writes (a scanned layer, or an unrolled one, which runs as a program of its own, would
# hand it another trace's values).
LOOPED = zoo.Policy(scan_layers=False)


def writes_with_noise(model, calls, kv_dtype, noises=None):
    """Run `calls` (token arrays, one cached forward each) from an empty cache, adding
    `noises[i]` to the i-th keys/values/latents written to pages (in order); the last call's
    logits and every written array (before the noise)."""
    written, stream = [], iter(noises) if noises is not None else None

    def noisy(pool, table, groups, positions, new, valid, *, layer=None):
        written.append(new)
        new = new if stream is None else new + next(stream)
        return paged_cache_write(pool, table, groups, positions, new, valid, layer=layer)

    cache = model.init_cache(calls[0].shape[0], 32, kv_dtype=kv_dtype)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(paged_cache, "write_pages", noisy)
        for tokens in calls:
            out = model.forward(tokens, cache=cache)
            cache = out.cache
    return out.logits, written


paged_cache_write = paged_cache.write_pages


@pytest.mark.parametrize("config", [LLAMA, MLA], ids=["llama", "mla"])
def test_int8_logits_within_the_derived_first_order_tolerance(config):
    """Each number the int8 cache holds is within half its step e_i of the float value written
    (test_paged_int8), so to first order the logits move by at most sum_i |dlogit/dx_i| e_i over
    every cached number x_i, the derivative taken through the whole cached computation (a
    layer's perturbed output changes the next layer's keys too). That worst case adds the
    errors' magnitudes; the real errors partly cancel, and the second-order term is O(e^2)
    with e about 1% of each vector's largest number."""
    model = zoo.Transformer(config, policy=LOOPED, key=jax.random.key(0))
    tokens = jax.random.randint(jax.random.key(1), (1, 8), 0, config.vocab_size)
    calls = [tokens[:, :7], tokens[:, 7:]]  # a prefill through the XLA path, then a decode step
    run = eqx.filter_jit(writes_with_noise)
    want, written = run(model, calls, None)
    got, _ = run(model, calls, "int8")
    zeros = [jnp.zeros_like(x) for x in written]

    # Forward mode: the paged walk's loop bounds are data, which reverse mode cannot take.
    @jax.jit
    def sensitivity(noises):  # per write: [batch, 1, vocab, *written.shape]
        return jax.jacfwd(lambda n: writes_with_noise(model, calls, None, n)[0])(noises)

    sensitivity = sensitivity(zeros)
    half_steps = [quantize(x)[1].astype(jnp.float32)[..., None] / 2 for x in written]
    tolerance = sum(
        jnp.einsum("bsv...,...->bsv", jnp.abs(j), jnp.broadcast_to(e, j.shape[3:]))
        for j, e in zip(sensitivity, half_steps, strict=True)
    )
    err = jnp.abs(got - want)
    assert float(err.max()) > 0  # the int8 cache is in use
    worst = float((err / tolerance).max())
    assert worst <= 1.0, f"int8 logits moved {worst:.2f}x the derived tolerance"


_step = eqx.filter_jit(lambda model, tokens, cache: model.forward(tokens, cache=cache))


def alone_int8(model, prompt, n):
    """Greedy continuation of one prompt through an int8 cache of its own (prefill, then one
    token per step): the specification the engine's int8 pools must meet."""
    out = _step(model, jnp.asarray([prompt]), model.init_cache(1, 64, kv_dtype="int8"))
    tokens = [int(jnp.argmax(out.logits[0, -1]))]
    for _ in range(n - 1):
        out = _step(model, jnp.asarray([[tokens[-1]]]), out.cache)
        tokens.append(int(jnp.argmax(out.logits[0, -1])))
    return tokens


@pytest.mark.parametrize("config", [LLAMA, MLA, GEMMA2], ids=["llama", "mla", "gemma2"])
def test_engine_with_int8_pools_equals_each_request_alone(config):
    """Decode rows and prompt chunks (prompts longer than a chunk) share int8 pools; a sliding
    layer keeps its float ring (Gemma 2)."""
    model = zoo.Transformer(config, policy=UNROLLED, key=jax.random.key(1))
    engine = Engine(
        model, max_batch=2, max_len=64, page_size=8, chunk=16, kv_dtype="int8", warm_up=False
    )  # only the step shapes these requests use compile
    cases = list(zip(prompts([5, 37]), [6, 3], strict=True))
    requests = [engine.submit(p, max_new_tokens=n) for p, n in cases]
    engine.run()
    for (prompt, n), request in zip(cases, requests, strict=True):
        assert request.tokens == alone_int8(model, prompt, n)


@pytest.fixture(scope="module")
def llama():
    return zoo.Transformer(LLAMA, key=jax.random.key(0))


def test_the_same_bytes_hold_twice_the_rows_and_run_them(llama):
    """float32 pages against int8 pages of head_dim 16: (16 + 2) / (4 * 16) of the bytes, so a
    pool of no more bytes holds more than twice the pages, and an engine of twice the rows
    runs them all at once without preempting anyone."""
    d = LLAMA.head_dim
    full = Engine(llama, max_batch=2, max_len=64, page_size=8, warm_up=False)
    rows = 2 * full.max_batch
    n_pages = rows * full.row_pages + 1
    small = Engine(llama, max_batch=rows, max_len=64, page_size=8, n_pages=n_pages,
                   kv_dtype="int8", warm_up=False)  # fmt: skip
    assert small.page_bytes * (4 * d) == full.page_bytes * (d + 2)
    for engine in (full, small):  # zoo.math's count is the pools' own
        per_token = kv_cache_bytes_per_token(LLAMA, llama.policy, kv_dtype=engine.kv_dtype)
        assert engine.page_bytes == engine.page_size * per_token
    assert n_pages * small.page_bytes <= full.pool.n_pages * full.page_bytes
    requests = [small.submit(p, max_new_tokens=64 - 50) for p in prompts([50] * rows)]
    small.run()
    assert max(r.decode_rows for r in small.records) == rows
    assert all(r.done and r.preemptions == 0 for r in requests)


def test_int8_against_bfloat16_pages_is_head_dim_plus_scale_over_twice_head_dim():
    """What 'half the bytes of bfloat16' means exactly: the scale costs 2 bytes per head."""
    bf16 = zoo.Policy(compute_dtype="bfloat16", param_dtype="bfloat16")
    for config in (LLAMA, zoo.preset("llama3-1b")):
        float_bytes = kv_cache_bytes_per_token(config, bf16)
        int8_bytes = kv_cache_bytes_per_token(config, bf16, kv_dtype="int8")
        d = config.head_dim
        assert int8_bytes * 2 * d == float_bytes * (d + 2)


def test_nothing_compiles_after_the_start(llama):
    engine = Engine(llama, max_batch=2, max_len=128, page_size=16, chunk=32, kv_dtype="int8")
    before = dict(TRACES)
    for length in (1, 31, 33, 100):
        engine.submit(prompts([length], seed=length)[0], max_new_tokens=128 - length)
    engine.run()
    assert dict(TRACES) == before


@pytest.mark.parametrize("config", [LLAMA.replace(n_kv_heads=4), MLA], ids=["mha", "mla"])
def test_plan_counts_the_int8_pools_as_placed(config):
    """training.plan's KV bytes per device against the real int8 cache (numbers and scales)
    placed on a tensor-parallel mesh by its logical axes (K/V heads split 4 ways)."""
    rules, mesh_shape = shard.ShardingRules.preset("tp"), {"data": 2, "tensor": 4}
    model = zoo.Transformer(config, key=jax.random.key(0))
    cache = shard.Placement(shard.mesh(**mesh_shape), rules).place_arrays(
        model.init_cache(8, 16, kv_dtype="int8")
    )
    p = plan(config, model.policy, rules, mesh_shape, batch=8, seq=16,
             hardware=HARDWARE["h100"], kv_dtype="int8")  # fmt: skip
    assert p.kv_cache == bytes_per_device(cache)


@pytest.mark.parametrize("kv_dtype", ["int4", "fp8", "q8_0"])
def test_unknown_kv_dtypes_are_refused_with_the_choices(llama, kv_dtype):
    message = "choose one of .*'float32', 'bfloat16', 'float16', 'int8'"
    with pytest.raises(ValueError, match=message):
        Engine(llama, max_batch=1, max_len=16, kv_dtype=kv_dtype, warm_up=False)
    with pytest.raises(ValueError, match=message):
        llama.init_cache(1, 16, kv_dtype=kv_dtype)
    with pytest.raises(ValueError, match=message):
        infer.generate(llama, [[1, 2]], max_new_tokens=2, sampler=infer.Greedy(),
                       key=jax.random.key(0), kv_dtype=kv_dtype)  # fmt: skip


def dequantized_writes(pool, table, groups, positions, new, valid, *, layer=None):
    """write_pages into a float pool of what an int8 pool stands for: each new token's
    `numbers * scales` (int8.py's quantize), so the pools differ only in how they are stored."""
    numbers, scales = quantize(new)
    new = numbers.astype(jnp.float32) * scales.astype(jnp.float32)[..., None]
    return paged_cache_write(pool, table, groups, positions, new, valid, layer=layer)


@pytest.mark.parametrize("context", [0, 40, 100], ids=["empty", "short", "long"])
def test_int8_cache_decodes_as_float_pools_of_its_dequantized_values(context):
    """Greedy decode through int8 pools against float32 pools holding the same dequantized
    numbers, from rows that already "hold" `context` zero tokens (bench/gpu_inference.py's
    decode_program: all-zero pools with preset lengths, so every zero token has scale 0): the
    pools store the same values, and the readers fold the scales into the scores and weights
    (`(q . n) s` for `q . (n s)`: one float32 rounding apart per product), so the logits agree to
    float32 rounding and the greedy tokens are equal; nothing is NaN or infinite."""
    model = zoo.Transformer(LLAMA, policy=UNROLLED, key=jax.random.key(2))
    batch, steps = 3, 6
    first = jax.random.randint(jax.random.key(3), (batch,), 0, LLAMA.vocab_size)

    @eqx.filter_jit
    def decode(model, kv_dtype, dequantized=False):
        if dequantized:  # traced with write_pages storing what the int8 pools stand for
            with pytest.MonkeyPatch.context() as patch:
                patch.setattr(paged_cache, "write_pages", dequantized_writes)
                return greedy(model, kv_dtype)
        return greedy(model, kv_dtype)

    def greedy(model, kv_dtype):
        cache = model.init_cache(batch, context + steps, page_size=8, kv_dtype=kv_dtype)
        cache = eqx.tree_at(lambda c: c.lengths, cache, jnp.full((batch,), context, jnp.int32))

        def step(carry, _):
            token, cache = carry
            out = model.forward(token[:, None], cache=cache)
            new = jnp.argmax(out.logits[:, 0], axis=-1).astype(token.dtype)
            return (new, out.cache), (new, out.logits[:, 0])

        (_, cache), (tokens, logits) = jax.lax.scan(step, (first, cache), None, length=steps)
        return tokens, logits, cache

    tokens, logits, cache = decode(model, "int8")
    want_tokens, want, _ = decode(model, "float32", dequantized=True)
    pools = jax.tree.leaves(cache.layers)
    assert all(bool(jnp.isfinite(p.astype(jnp.float32)).all()) for p in pools)
    assert bool(jnp.isfinite(logits).all())
    assert (tokens == want_tokens).all()
    # Float32 rounds each operation by 2^-24; a stored number differing in bfloat16's last
    # place (2^-8) would show as more. 2^-16 sits 256x from each.
    err = jnp.max(jnp.abs(logits - want)) / jnp.max(jnp.abs(want))
    assert float(err) <= 2.0**-16, f"int8 vs dequantized float pools: {float(err):.3g}"
