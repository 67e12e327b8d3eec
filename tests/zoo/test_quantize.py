"""zoo.quantize (inference) and zoo.quantize_base (QLoRA's frozen base): what is packed for every
family, the quantized model against the float model of its dequantized weights, stacked ==
unrolled, bytes == zoo.math's prediction, the engine and generate on quantized models, the
frozen base under jit and AdamW, LoRA on a quantized base, export, sharding, bad inputs.

Tolerance: a quantized model with float activations (the default: the kernels take x as it
is) and the float model holding its dequantized weights compute the
same function with each matrix product summed in another order (the kernels: per group, then
scaled; layers/kernels/quantized), so they are compared with the tolerance of
tests/zoo/test_transformer.py for the same weights under another schedule; each product's own
bound is tests/layers/test_quantized.py's, which also holds int8 activations to theirs (x
rounded per 32 inputs; a rounding that flips between two schedules of the same model moves a
logit by far more than float rounding, so exact-schedule comparisons take float activations,
the default).
"""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import infer
import shard
import zoo
from infer.engine import PROMPT_TOKENS
from layers import Embedding, Linear, LoRA, QuantizedEmbedding, QuantizedLinear
from layers.kernels.cpu import integer_products
from layers.kernels.quantized import KERNEL_TOKENS
from layers.moe import Experts, QuantizedExperts
from layers.quantized import with_activations
from training.step import split_model

TOKENS = jax.random.randint(jax.random.key(1), (2, 10), 0, 256)  # the kernel path
LONG = jax.random.randint(jax.random.key(2), (1, KERNEL_TOKENS + 8), 0, 256)  # dequant + XLA
FAMILIES = {
    "tiny-llama": {},
    "tiny-gpt2": {},  # biases (kept float), learned positions, a GELU MLP, tied head
    "tiny-moe": {},  # experts packed, router float
    "tiny-deepseek-moe": {},  # shared experts, dense first layer
    "tiny-deepseek-v3": {"mla_q_rank": 32},  # MLA: every row a multiple of 32 but kv_b (float)
}
SAME = {"rtol": 1e-5, "atol": 1e-5}


def tiny(name="tiny-llama", **changes):
    changes = FAMILIES.get(name, {}) | changes
    return zoo.Transformer(zoo.preset(name, **changes), key=jax.random.key(0))


def of_type(model, kind) -> list:
    return [
        n
        for n in jax.tree.leaves(model, is_leaf=lambda n: isinstance(n, kind))
        if isinstance(n, kind)
    ]


def n_bytes(model) -> int:
    return sum(x.nbytes for x in jax.tree.leaves(eqx.filter(model, eqx.is_array)))


def test_what_is_packed_and_what_stays_float():
    model = tiny("tiny-moe", tie_embeddings=False)
    q = zoo.quantize(model, "int4")
    layer = q.layer(0)
    for proj in (layer.attn.q_proj, layer.attn.k_proj, layer.attn.v_proj, layer.attn.o_proj):
        assert isinstance(proj, QuantizedLinear) and proj.kind == "int4"
    assert isinstance(layer.mlp.experts, QuantizedExperts) and layer.mlp.experts.kind == "int4"
    assert layer.mlp.router.weight.dtype == jnp.float32  # the router stays float
    assert isinstance(q.embed, QuantizedEmbedding) and q.embed.kind == "int8"
    assert isinstance(q.lm_head, QuantizedLinear) and q.lm_head.kind == "int8"
    assert q.final_norm.scale is model.final_norm.scale
    float_head = zoo.quantize(model, "int8", embeddings=None)
    assert isinstance(float_head.embed, Embedding) and isinstance(float_head.lm_head, Linear)
    base = zoo.quantize_base(model, "nf4", block=64)
    assert isinstance(base.layer(0).attn.q_proj, QuantizedLinear)
    assert isinstance(base.layer(0).mlp.experts, Experts) and isinstance(base.embed, Embedding)


def test_mla_keeps_its_up_projection_float():
    q = zoo.quantize(tiny("tiny-deepseek-v3"), "int8")
    attn = q.layer(0).attn
    assert isinstance(attn.q_a_proj, QuantizedLinear) and isinstance(attn.o_proj, QuantizedLinear)
    assert type(attn.kv_b_proj) is Linear  # decode multiplies by its weight (absorbed form)


# Each family once, the kinds spread over them (suite time; every kind's products are checked
# against their bound in tests/layers/test_quantized.py).
@pytest.mark.parametrize(
    "name, kind",
    [("tiny-llama", "nf4"), ("tiny-gpt2", "int8"), ("tiny-moe", "int4"),
     ("tiny-deepseek-moe", "int4"), ("tiny-deepseek-v3", "int8")],
)  # fmt: skip
def test_quantized_model_is_the_float_model_of_its_dequantized_weights(name, kind):
    group = 32 if kind == "nf4" and name.startswith("tiny-deepseek") else None
    q = zoo.quantize(tiny(name), kind, group=group)
    dequantized = zoo.dequantize(q)
    assert not of_type(dequantized, QuantizedLinear) and not of_type(dequantized, QuantizedExperts)
    forward = eqx.filter_jit(lambda m, t: m(t))
    for tokens in (TOKENS, LONG):
        np.testing.assert_allclose(forward(q, tokens), forward(dequantized, tokens), **SAME)


@pytest.mark.parametrize("kind", ["int8", "int4"])
def test_stacked_and_unrolled_quantize_alike(kind):
    model = tiny(n_layers=3)
    stacked = zoo.quantize(model, kind)
    unrolled = zoo.quantize(model.with_policy(storage="unrolled"), kind)
    converted = stacked.with_policy(storage="unrolled")
    for a, b in zip(jax.tree.leaves(converted), jax.tree.leaves(unrolled), strict=True):
        np.testing.assert_array_equal(a, b)
    np.testing.assert_allclose(_forward(stacked, TOKENS), _forward(unrolled, TOKENS), **SAME)


@pytest.mark.parametrize(
    "name, changes, dtype",
    [
        ("tiny-llama", {}, "float32"),
        ("tiny-llama", {"tie_embeddings": False}, "bfloat16"),
        ("tiny-gpt2", {}, "float32"),
        ("tiny-moe", {}, "float32"),
        ("tiny-deepseek-moe", {}, "float32"),
    ],
)
@pytest.mark.parametrize("kind, group", [("int8", None), ("int4", 32), ("nf4", 32)])
def test_bytes_match_the_prediction(name, changes, dtype, kind, group):
    policy = zoo.Policy.of_dtype(dtype)
    model = zoo.Transformer(zoo.preset(name, **changes), policy=policy, key=jax.random.key(0))
    predicted = zoo.math.quantized_weight_bytes(model.config, kind, policy, group=group)
    assert n_bytes(zoo.quantize(model, kind, group=group)) == predicted
    assert predicted < zoo.math.weight_bytes(model.config, policy)
    base = zoo.math.frozen_base_bytes(model.config, kind, policy, block=group or 64)
    assert n_bytes(zoo.quantize_base(model, kind, block=group or 64)) == base


@pytest.mark.parametrize("kind", ["int8", "int4"])
def test_cached_decode_runs_on_the_quantized_model(kind):
    # Prefill + decode == the full forward (the cache path calls the same projections).
    q = zoo.quantize(tiny(n_layers=2), kind)
    full = q(TOKENS)
    out = q.forward(TOKENS[:, :8], cache=q.init_cache(2, 12))
    np.testing.assert_allclose(out.logits, full[:, :8], **SAME)
    step = q.forward(TOKENS[:, 8:9], cache=out.cache)
    np.testing.assert_allclose(step.logits[:, 0], full[:, 8], **SAME)


_forward = eqx.filter_jit(lambda model, tokens: model(tokens))


def greedy(model, prompt: list[int], n: int) -> list[int]:
    """Greedy continuation by full forwards (the specification), right-padded to 32 tokens."""
    tokens = list(prompt)
    for _ in range(n):
        row = jnp.asarray([tokens + [0] * (32 - len(tokens))])
        tokens.append(int(jnp.argmax(_forward(model, row)[0, len(tokens) - 1])))
    return tokens[len(prompt) :]


@pytest.mark.parametrize("name, kind", [("tiny-llama", "int4"), ("tiny-moe", "int8")])
def test_engine_and_generate_run_quantized_models_unchanged(name, kind):
    # Float activations (the default): a random tiny model's logits are near ties, which the
    # int8 rounding of a row's activations (per token, the same on both paths only for
    # bit-equal inputs) could flip.
    q = zoo.quantize(tiny(name, n_layers=2), kind).with_policy(storage="unrolled")
    cases = [([5, 17, 3, 99, 4], 6), ([7] * 12, 4), ([1, 2], 8)]
    engine = infer.Engine(q, max_batch=2, max_len=32, warm_up=False)  # compiles what it runs
    requests = [engine.submit(p, max_new_tokens=n) for p, n in cases]
    engine.run()
    generated = infer.generate(
        q, [p for p, _ in cases], max_new_tokens=4, sampler=infer.Greedy(), key=jax.random.key(0)
    )
    for (prompt, n), request, tokens in zip(cases, requests, generated, strict=True):
        expected = greedy(q, prompt, n)
        assert request.done and request.tokens == expected
        assert tokens == expected[:4]


def test_int8_activations_give_each_request_the_bits_it_gets_alone():
    """int8 activations round each token's x, so a last-bit change anywhere before a packed
    product (a norm summed in another order beside other tokens, say) can flip a code, and
    then a logit by far more than float rounding. Every op of a step computes each token in
    an order of its own (the packed kernel's, `row_mean`, the C++ attention per query token),
    so requests run together get the log-probabilities they get one at a time, bit for bit.
    SmolLM2's width (576: XLA's reduction changed its norms' bits with the tokens beside
    them), steps of at most 20 tokens (a CPU without VNNI: the float walks of fewer than 32
    tokens, per token too)."""
    config = dict(d_model=576, n_heads=9, n_kv_heads=3, head_dim=64, d_ff=1536, n_layers=2)
    q = with_activations(zoo.quantize(tiny(**config), "int4"), "int8")
    cases = [(list(range(3, 3 + n)), m) for n, m in [(23, 6), (5, 9), (40, 4), (9, 7)]]

    def engine():
        return infer.Engine(q, max_batch=4, max_len=64, token_budget=4 + 16, warm_up=False)

    together = engine()
    requests = [together.submit(p, max_new_tokens=m, logprobs=1) for p, m in cases]
    together.run()
    for (prompt, n), request in zip(cases, requests, strict=True):
        alone = engine()
        single = alone.submit(prompt, max_new_tokens=n, logprobs=1)
        alone.run()
        assert single.tokens == request.tokens
        assert [t.logprob for t in single.token_logprobs] == [
            t.logprob for t in request.token_logprobs
        ]


def test_an_engine_over_packed_weights_keeps_its_steps_in_the_packed_kernel():
    """On a CPU, by default, an engine over packed weights takes the prompt chunks that keep a
    step within the packed kernel's `KERNEL_TOKENS`: its largest step program multiplies by the
    packed weights and never dequantizes one (a float copy of every weight, every step, as
    its 256 prompt tokens did). A float model keeps the 256, and so do int8 activations on a
    CPU with AVX-512 VNNI."""
    q = zoo.quantize(tiny(n_layers=2), "int4").with_policy(storage="unrolled")
    engine = infer.Engine(q, max_batch=2, max_len=64, warm_up=False)
    assert engine.token_budget == 2 + 5 * 16 <= KERNEL_TOKENS
    largest = engine._plan([], [], max(engine.prompt_shapes), {}, None)
    program = engine._lower(largest, engine.state).as_text()
    assert "@zoo_quantized_matmul" in program and "@zoo_quantized_dequantize" not in program
    float_engine = infer.Engine(tiny(n_layers=2), max_batch=2, max_len=64, warm_up=False)
    assert float_engine.token_budget == 2 + PROMPT_TOKENS
    # int8 activations on a CPU with VNNI: groups of 32 take the kernel at any token count
    # (`kernel_tokens`), so the engine keeps the 256 prompt tokens, still without a float copy.
    # (the embedding left float: zoo.quantize's int8 table is per channel, not in groups of 32)
    rounded = with_activations(zoo.quantize(tiny(n_layers=2), "int4", embeddings=None), "int8")
    engine = infer.Engine(rounded.with_policy(storage="unrolled"), max_batch=2, max_len=64,
                          warm_up=False)  # fmt: skip
    integer = integer_products()
    assert engine.token_budget == (2 + PROMPT_TOKENS if integer else 2 + 5 * 16)
    largest = engine._plan([], [], max(engine.prompt_shapes), {}, None)
    program = engine._lower(largest, engine.state).as_text()
    assert "@zoo_quantized_matmul" in program and "@zoo_quantized_dequantize" not in program


def test_quantized_base_is_frozen_under_jit_and_adamw():
    q = zoo.quantize_base(tiny(), "nf4", block=64)
    params, static = split_model(q)
    assert not any(jax.tree.leaves(p) for p in of_type(params, QuantizedLinear))

    def loss(p):
        return jnp.mean(eqx.combine(p, static)(TOKENS) ** 2)

    optimizer = optax.adamw(1e-2, weight_decay=0.1)

    @jax.jit
    def step(p, state):
        updates, state = optimizer.update(jax.grad(loss)(p), state, p)
        return optax.apply_updates(p, updates)

    moved = eqx.combine(step(params, optimizer.init(params)), static)
    for before, after in zip(
        of_type(q, QuantizedLinear), of_type(moved, QuantizedLinear), strict=True
    ):
        for a, b in zip(jax.tree.leaves(before), jax.tree.leaves(after), strict=True):
            np.testing.assert_array_equal(a, b)
    assert not np.array_equal(moved.embed.weight, q.embed.weight)  # the rest does train


def test_lora_trains_on_a_quantized_base_and_refuses_to_merge_into_it():
    q = zoo.quantize(tiny(), "int4")
    adapted = zoo.add_lora(q, ["q_proj", "v_proj"], 4, 8, key=jax.random.key(3))
    assert isinstance(adapted.layer(0).attn.q_proj, LoRA)
    trainable, frozen = zoo.adapter.split_trainable(adapted)

    def loss(t):
        return jnp.mean(eqx.combine(t, frozen)(TOKENS) ** 2)

    grads = jax.jit(jax.grad(loss))(trainable)  # one program, not op by op
    assert any(np.any(np.asarray(g) != 0) for g in jax.tree.leaves(grads))
    with pytest.raises(TypeError, match=r"QuantizedLinear.*zoo\.dequantize"):
        zoo.merge_adapter(adapted)


def test_export_refuses_packed_weights_or_writes_their_float(tmp_path):
    q = zoo.quantize(tiny(), "int8")
    with pytest.raises(ValueError, match=r"quantized \(int8\).*dequantize=True"):
        zoo.save_pretrained(q, tmp_path / "refused")
    assert not (tmp_path / "refused").exists()
    zoo.save_pretrained(q, tmp_path / "float", dequantize=True)
    loaded = zoo.load_pretrained(tmp_path / "float", policy=q.policy)
    for a, b in zip(jax.tree.leaves(zoo.dequantize(q)), jax.tree.leaves(loaded), strict=True):
        np.testing.assert_array_equal(a, b)


def test_nf4_shards_like_the_float_weights_and_refuses_uneven_groups():
    q = zoo.quantize_base(tiny(), "nf4", block=16)
    rules = shard.ShardingRules.preset("fsdp")
    # embed 64 / group 16 = 4 groups per row: 4-way fsdp splits them evenly...
    placed = shard.shard_model(q, rules, shard.mesh(data=2, fsdp=4))
    np.testing.assert_allclose(placed(TOKENS), q(TOKENS), **SAME)
    # ...8-way cannot: the packed codes (32 bytes per row) would split, their scales (4) not.
    with pytest.raises(ValueError, match=r"q_proj\.packed\.scales: dimension 'embed' of size 4"):
        shard.param_shardings(q, rules, shard.mesh(fsdp=8))


# --- bad inputs -----------------------------------------------------------------------------


def test_bad_kind_and_group_are_refused_before_anything_is_packed(without_runtime_typechecks):
    model = tiny()
    with pytest.raises(ValueError, match="kind 'fp8' is not one of"):
        zoo.quantize(model, "fp8")
    with pytest.raises(ValueError, match=r"group size 96 must divide the 64 inputs of a row"):
        zoo.quantize(model, "int4", group=96)
    with pytest.raises(ValueError, match=r"experts\.down .*group size 64 must divide the 32"):
        zoo.quantize(tiny("tiny-deepseek-moe"), "nf4")  # its experts' rows are 32 wide
    with pytest.raises(ValueError, match=r"16 inputs per row is not a multiple of 32"):
        zoo.quantize(zoo.Transformer(zoo.preset("tiny-deepseek-v3"), key=jax.random.key(0)), "int8")


def test_quantized_fused_or_adapted_models_are_refused():
    model = tiny()
    q = zoo.quantize(model, "int8")
    with pytest.raises(ValueError, match=r"already quantized \(int8\); quantize the float model"):
        zoo.quantize(q, "int4")
    with pytest.raises(ValueError, match=r"already quantized"):
        zoo.quantize_base(q, "nf4")
    with pytest.raises(ValueError, match=r"Policy.fused"):
        zoo.quantize(model.with_policy(fused=True), "int8")
    adapted = zoo.add_lora(model, ["q_proj"], 4, 8, key=jax.random.key(0))
    with pytest.raises(ValueError, match=r"without LoRA adapters: merge them first"):
        zoo.quantize(adapted, "int8")
    with pytest.raises(ValueError, match=r"plain Linear projections.*quantized"):
        q.with_policy(fused=True)
