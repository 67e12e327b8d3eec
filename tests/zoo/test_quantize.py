"""zoo.quantize_base: which projections become QuantizedLinear, the quantized model against the
float one, stacked == unrolled, the base is frozen under jit and AdamW, bytes == zoo.math's
prediction, sharding, errors.

Logits bound: quantization error does not pass through attention's softmax and SwiGLU by a bound
worth stating, so the model is checked in two parts that together pin it down: (1) every
projection of the quantized model is within the per-weight bound of tests/layers/
test_quantized.py, carried through its matmul on inputs of the model's width; (2) the quantized
model computes exactly the float model that holds its dequantized weights
(`zoo.dequantize_base`), so nothing but those weights changed.
"""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import shard
import zoo
from layers import Linear, QuantizedLinear
from tests.layers.test_quantized import EPS, error_bound
from training.step import split_model

KINDS = [("int8", 64), ("nf4", 16)]  # tiny-llama's head_dim (o_proj's last input dim) is 16
TOKENS = jax.random.randint(jax.random.key(1), (2, 10), 0, 256)


def tiny(name="tiny-llama", **changes):
    return zoo.Transformer(zoo.preset(name, **changes), key=jax.random.key(0))


def is_projection(node) -> bool:
    return isinstance(node, Linear | QuantizedLinear)


def projections(model):
    leaves = jax.tree.leaves(model.stacks, is_leaf=is_projection)
    return [leaf for leaf in leaves if is_projection(leaf)]


@pytest.mark.parametrize("kind, block", KINDS)
def test_projections_are_quantized_embeddings_norms_head_are_not(kind, block):
    model = tiny(tie_embeddings=False)
    q = zoo.quantize_base(model, kind, block=block)
    layer = q.layer(0)
    for proj in (layer.attn.q_proj, layer.attn.k_proj, layer.attn.v_proj, layer.attn.o_proj):
        assert isinstance(proj, QuantizedLinear) and proj.kind == kind
    for proj in (layer.mlp.gate, layer.mlp.up, layer.mlp.down):
        assert isinstance(proj, QuantizedLinear)
    assert isinstance(q.lm_head, Linear)
    assert q.embed.weight is model.embed.weight and q.lm_head.weight is model.lm_head.weight
    assert q.final_norm.scale is model.final_norm.scale
    assert layer.attn_norm.scale.dtype == jnp.float32


@pytest.mark.parametrize("kind, block", KINDS)
def test_every_projection_within_its_matmul_bound(kind, block):
    model = tiny()
    q = zoo.quantize_base(model, kind, block=block)
    for float_proj, q_proj in zip(projections(model), projections(q), strict=True):
        n_in = len(q_proj.in_shape)
        # Stacked: [layers, *in, *out] weights; one input row per layer, batched over layers.
        x = jax.random.normal(jax.random.key(2), (float_proj.weight.shape[0], 3, *q_proj.in_shape))
        y = jax.vmap(lambda p, x: p(x))(q_proj, x)
        reference = jax.vmap(lambda p, x: p(x))(float_proj, x)
        w, bound = float_proj.weight, jax.vmap(error_bound)(q_proj, float_proj.weight)
        contract = (tuple(range(1, 1 + n_in)), tuple(range(n_in)))
        dot = jax.vmap(lambda a, b, c=contract: jnp.tensordot(a, b, axes=c))
        n = int(np.prod(q_proj.in_shape))
        allowed = dot(jnp.abs(x), bound) + n * EPS * dot(jnp.abs(x), jnp.abs(w) + bound)
        assert bool(jnp.all(jnp.abs(y - reference) <= allowed))


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-gpt2"])
@pytest.mark.parametrize("kind, block", KINDS)
def test_quantized_model_is_the_float_model_of_its_dequantized_weights(name, kind, block):
    q = zoo.quantize_base(tiny(name), kind, block=block)
    dequantized = zoo.dequantize_base(q)
    assert not any(isinstance(p, QuantizedLinear) for p in projections(dequantized))
    np.testing.assert_array_equal(q(TOKENS), dequantized(TOKENS))


@pytest.mark.parametrize("kind, block", KINDS)
def test_stacked_and_unrolled_quantize_alike(kind, block):
    model = tiny(n_layers=3)
    stacked = zoo.quantize_base(model, kind, block=block)
    unrolled = zoo.quantize_base(model.with_policy(storage="unrolled"), kind, block=block)
    for a, b in zip(
        jax.tree.leaves(stacked.with_policy(storage="unrolled")),
        jax.tree.leaves(unrolled),
        strict=True,
    ):
        np.testing.assert_array_equal(a, b)
    # Same weights, scan vs Python loop: the tolerance of tests/zoo/test_transformer.py.
    np.testing.assert_allclose(stacked(TOKENS), unrolled(TOKENS), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kind, block", KINDS)
def test_base_is_frozen_under_jit_and_adamw(kind, block):
    q = zoo.quantize_base(tiny(), kind, block=block)
    params, static = split_model(q)
    # No array of a quantized projection is trainable (its codes, scales and bias alike).
    assert not any(
        jax.tree.leaves(p) for p in projections(params) if isinstance(p, QuantizedLinear)
    )
    n_trainable = sum(x.size for x in jax.tree.leaves(params))
    assert n_trainable == zoo.math.param_count(q.config) - sum(
        int(np.prod(p.weight.shape)) for p in projections(tiny())
    )

    def loss(p):
        return jnp.mean(eqx.combine(p, static)(TOKENS) ** 2)

    optimizer = optax.adamw(1e-2, weight_decay=0.1)

    @jax.jit
    def step(p, state):
        grads = jax.grad(loss)(p)
        updates, state = optimizer.update(grads, state, p)
        return optax.apply_updates(p, updates), grads

    new_params, grads = step(params, optimizer.init(params))
    assert not any(jax.tree.leaves(g) for g in projections(grads) if isinstance(g, QuantizedLinear))
    moved = eqx.combine(new_params, static)
    for before, after in zip(projections(q), projections(moved), strict=True):
        for a, b in zip(jax.tree.leaves(before), jax.tree.leaves(after), strict=True):
            np.testing.assert_array_equal(a, b)
    assert not np.array_equal(moved.embed.weight, q.embed.weight)  # the rest does train


@pytest.mark.parametrize("kind, block", KINDS)
@pytest.mark.parametrize(
    "name, changes, dtype",
    [
        ("tiny-llama", {}, "float32"),
        ("tiny-llama", {"tie_embeddings": False}, "bfloat16"),
        ("tiny-gpt2", {}, "float32"),  # biases (kept float) and a GELU MLP
        ("tiny-moe", {}, "float32"),  # experts and router kept float
    ],
)
def test_bytes_match_the_prediction(kind, block, name, changes, dtype):
    policy = zoo.Policy.of_dtype(dtype)
    model = zoo.Transformer(zoo.preset(name, **changes), policy=policy, key=jax.random.key(0))
    q = zoo.quantize_base(model, kind, block=block)
    measured = sum(x.nbytes for x in jax.tree.leaves(eqx.filter(q, eqx.is_array)))
    predicted = zoo.math.frozen_base_bytes(model.config, kind, policy, block=block)
    assert measured == predicted
    assert predicted < zoo.math.frozen_base_bytes(model.config, None, policy)
    assert zoo.math.frozen_base_bytes(model.config, None, policy) == zoo.math.weight_bytes(
        model.config, policy
    )


@pytest.mark.parametrize("kind, block", KINDS)
def test_cached_decode_runs_on_the_quantized_base(kind, block):
    # The KV-cache path calls the same projections: prefill + decode == the full forward, with
    # the tolerance of tests/zoo/test_transformer.py (same weights, another schedule).
    q = zoo.quantize_base(tiny(n_layers=2), kind, block=block)
    full = q(TOKENS)
    out = q.forward(TOKENS[:, :8], cache=q.init_cache(2, 12))
    np.testing.assert_allclose(out.logits, full[:, :8], rtol=1e-5, atol=1e-5)
    step = q.forward(TOKENS[:, 8:9], cache=out.cache)
    np.testing.assert_allclose(step.logits[:, 0], full[:, 8], rtol=1e-5, atol=1e-5)


def test_nf4_shards_like_the_float_weights_and_refuses_uneven_blocks():
    q = zoo.quantize_base(tiny(), "nf4", block=16)
    rules = shard.ShardingRules.preset("fsdp")
    # embed 64 / block 16 = 4 blocks per channel: 4-way fsdp splits them evenly...
    placed = shard.shard_model(q, rules, shard.mesh(data=2, fsdp=4))
    np.testing.assert_allclose(placed(TOKENS), q(TOKENS), rtol=1e-5, atol=1e-5)
    # ...8-way cannot: the packed codes (32) would split, their scales (4) not.
    with pytest.raises(ValueError, match=r"q_proj\.scales: dimension 'embed' of size 4 does not"):
        shard.param_shardings(q, rules, shard.mesh(fsdp=8))


def test_bad_kind_and_block_are_refused(without_runtime_typechecks):
    model = tiny()
    with pytest.raises(ValueError, match="kind 'fp8' is not one of"):
        zoo.quantize_base(model, "fp8")
    # q_proj's last input dim is embed (64), o_proj's head_dim (16): block 64 fits one, not both.
    with pytest.raises(
        ValueError, match=r"nf4 block 64 must .* last input dim 16 \(in_shape \(4, 16\)\)"
    ):
        zoo.quantize_base(model, "nf4", block=64)
    with pytest.raises(
        ValueError, match=r"nf4 block 64 must .* last input dim 16 \(in_shape \(4, 16\)\)"
    ):
        zoo.math.frozen_base_bytes(model.config, "nf4", block=64)
