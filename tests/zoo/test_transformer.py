"""The assembled Transformer: shapes, parameter counts, scan == loop == unrolled storage, one
stack type for dense and interleaved MoE models, compile size, errors."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import zoo
from zoo.transformer import positions_from_segments

TINY = ["tiny-gpt2", "tiny-llama"]


def n_leaves(model):
    return sum(x.size for x in jax.tree.leaves(eqx.filter(model, eqx.is_array)))


@pytest.mark.parametrize("name", TINY)
@pytest.mark.parametrize(
    "changes", [{}, {"tie_embeddings": False}, {"qk_norm": True}, {"bias": False}, {"mlp": "gelu"}]
)
def test_param_count_matches_leaves(name, changes):
    config = zoo.preset(name, **changes)
    model = zoo.Transformer(config, key=jax.random.key(0))
    assert n_leaves(model) == zoo.math.param_count(config)


@pytest.mark.parametrize("name", TINY)
def test_forward_shape_and_dtype(name):
    model = zoo.Transformer(zoo.preset(name), key=jax.random.key(0))
    logits = model(jnp.zeros((2, 12), jnp.int32))
    assert logits.shape == (2, 12, 256) and logits.dtype == jnp.float32


def test_bfloat16_compute_with_float32_weights():
    policy = zoo.Policy(compute_dtype="bfloat16")
    model = zoo.Transformer(zoo.preset("tiny-llama"), policy=policy, key=jax.random.key(0))
    assert model.embed.weight.dtype == jnp.float32
    assert model(jnp.zeros((1, 4), jnp.int32)).dtype == jnp.bfloat16


# Dense models, and MoE models whose stacks differ: one stack of MoE layers (tiny-moe), a
# leading dense stack then MoE (tiny-deepseek-moe), and dense/MoE layers alternating in one stack.
STACKINGS = [
    ("tiny-gpt2", {}),
    ("tiny-llama", {}),
    ("tiny-moe", {}),
    ("tiny-deepseek-moe", {}),
    ("tiny-moe", {"n_layers": 5, "first_dense_layers": 1, "moe_every": 2}),
]


# The stackings without remat (the single MoE stack is a period of one, as the dense models'
# are); the remat policies on the model with two stacks (leading dense layers, then MoE), whose
# scan carries router statistics through the checkpointed blocks.
REMATS = [(*stacking, "none") for stacking in STACKINGS if stacking != ("tiny-moe", {})] + [
    ("tiny-deepseek-moe", {}, remat) for remat in ("full", "dots")
]
# Cached decode per storage: dense with learned and rotary positions, and the interleaved MoE
# stack (MoE caches with a leading dense stack: tests/infer/test_cache.py's MoE ragged decode).
CACHED = [("tiny-gpt2", {}), ("tiny-llama", {}), STACKINGS[-1]]


@pytest.mark.parametrize("name, changes, remat", REMATS)
def test_scan_equals_loop_equals_unrolled_storage(name, changes, remat):
    config = zoo.preset(name, **{"n_layers": 3, **changes})
    policy = zoo.Policy(remat=remat)
    scanned = zoo.Transformer(config, policy=policy, key=jax.random.key(0))
    looped = scanned.with_policy(scan_layers=False)
    unrolled = scanned.with_policy(storage="unrolled")
    tokens = jax.random.randint(jax.random.key(1), (2, 10), 0, 256)
    forward = eqx.filter_jit(lambda model: model.forward(tokens))  # one program, not op by op
    out = forward(scanned)
    for other in (looped, unrolled):
        other_out = forward(other)
        np.testing.assert_allclose(out.logits, other_out.logits, rtol=1e-5, atol=1e-5)
        for a, b in zip(jax.tree.leaves(out.aux), jax.tree.leaves(other_out.aux), strict=True):
            np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)

    def loss(model):
        return jnp.mean(model(tokens) ** 2)

    grad = eqx.filter_jit(eqx.filter_grad(loss))
    g_scan = jax.tree.leaves(grad(scanned))
    g_loop = jax.tree.leaves(grad(looped))
    for a, b in zip(g_scan, g_loop, strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("name, changes", STACKINGS)
def test_layers_are_the_configs_layers_in_order(name, changes):
    config = zoo.preset(name, **{"n_layers": 3, **changes})
    model = zoo.Transformer(config, key=jax.random.key(0))
    moe_layers = tuple(i for i in range(config.n_layers) if hasattr(model.layer(i).mlp, "router"))
    assert moe_layers == config.moe_layers
    assert model.forward(jnp.zeros((1, 4), jnp.int32)).aux.z_loss.shape == (len(moe_layers),)
    unrolled = model.with_policy(storage="unrolled")
    for i in range(config.n_layers):
        for a, b in zip(
            jax.tree.leaves(model.layer(i)), jax.tree.leaves(unrolled.layer(i)), strict=True
        ):
            np.testing.assert_array_equal(a, b)


# One compiled program per model and shape: dispatching each op of a model eagerly costs more
# (test_cached_prefill_and_decode_equal_the_full_forward: 39 -> 16 s).
_cached_forward = eqx.filter_jit(lambda model, tokens, cache: model.forward(tokens, cache=cache))


@pytest.mark.parametrize("name, changes", CACHED)
def test_cached_prefill_and_decode_equal_the_full_forward(name, changes):
    config = zoo.preset(name, **{"n_layers": 3, **changes})
    model = zoo.Transformer(config, key=jax.random.key(0))
    tokens = jax.random.randint(jax.random.key(1), (2, 9), 0, 256)
    full = model(tokens)
    for storage in (model, model.with_policy(storage="unrolled")):
        out = _cached_forward(storage, tokens[:, :6], storage.init_cache(2, 12))
        np.testing.assert_allclose(out.logits, full[:, :6], rtol=1e-5, atol=1e-5)
        cache = out.cache
        for t in range(6, 9):
            step = _cached_forward(storage, tokens[:, t : t + 1], cache)
            np.testing.assert_allclose(step.logits[:, 0], full[:, t], rtol=1e-5, atol=1e-5)
            cache = step.cache
        assert cache.lengths.tolist() == [9, 9]


# Family features not covered by the cached-decode tests of tests/zoo/test_families.py (Qwen3-MoE,
# Phi-3), test_gemma.py (Gemma 3, Gemma 2 through the engine) and test_deepseek.py (MLA): q/k/v
# biases, q/k norms with their own head_dim, and Gemma 2's soft-capped, sandwich-normed layers
# with a window (4) shorter than the decoded sequence on every other layer.
FAMILY_FEATURES = {
    "qwen2": {"qkv_bias": True},
    "qwen3": {"qk_norm": True, "head_dim": 24},
    "gemma2": {
        "norm_plus_one": True, "mlp": "geglu", "sandwich_norm": True, "embed_scale": True,
        "attn_softcap": 5.0, "final_softcap": 3.0, "query_scale": 8.0, "sliding_window": 4,
        "layer_types": ("sliding", "full", "sliding"),
    },
}  # fmt: skip


@pytest.mark.parametrize("family", FAMILY_FEATURES)
def test_family_features_decode_like_the_full_forward(family):
    config = zoo.preset("tiny-llama", n_layers=3, **FAMILY_FEATURES[family])
    policy = zoo.Policy(attention="naive")  # xla cannot soft-cap
    model = zoo.Transformer(config, policy=policy, key=jax.random.key(0))
    tokens = jax.random.randint(jax.random.key(1), (2, 9), 0, 256)
    full = model(tokens)
    out = _cached_forward(model, tokens[:, :5], model.init_cache(2, 12))
    np.testing.assert_allclose(out.logits, full[:, :5], rtol=1e-5, atol=1e-5)
    cache = out.cache
    for t in range(5, 9):
        step = _cached_forward(model, tokens[:, t : t + 1], cache)
        np.testing.assert_allclose(step.logits[:, 0], full[:, t], rtol=1e-5, atol=1e-5)
        cache = step.cache


def test_logits_at_picks_tokens_of_the_flattened_batch():
    model = zoo.Transformer(zoo.preset("tiny-llama"), key=jax.random.key(0))
    tokens = jax.random.randint(jax.random.key(1), (2, 7), 0, 256)
    picked = model.forward(tokens, logits_at=jnp.array([6, 7 + 2, 0])).logits
    full = model(tokens)
    np.testing.assert_allclose(picked, full[jnp.array([0, 1, 0]), jnp.array([6, 2, 0])], rtol=1e-6)


def test_a_cache_numbers_its_own_positions():
    model = zoo.Transformer(zoo.preset("tiny-llama"), key=jax.random.key(0))
    cache = model.init_cache(1, 8)
    with pytest.raises(ValueError, match="do not pass positions"):
        model.forward(jnp.zeros((1, 2), jnp.int32), positions=jnp.zeros((1, 2), jnp.int32),
                      cache=cache)  # fmt: skip


def hlo_size(n_layers: int) -> int:
    config = zoo.preset("tiny-moe", n_layers=n_layers, first_dense_layers=1, moe_every=2)
    model = zoo.Transformer(config, key=jax.random.key(0))
    tokens = jnp.zeros((1, 8), jnp.int32)
    return len(eqx.filter_jit(lambda m, t: m(t)).lower(model, tokens).as_text())


def test_program_size_does_not_grow_with_depth():
    # Compile time follows program size; a scanned stack keeps one copy of each period's block,
    # here a leading dense layer then (dense, MoE) periods, repeated 2 or 6 times.
    five, thirteen = hlo_size(5), hlo_size(13)
    assert abs(thirteen - five) / five < 0.02


def test_positions_restart_per_segment():
    seg = jnp.array([[1, 1, 1, 2, 2, 3]])
    np.testing.assert_array_equal(positions_from_segments(seg), [[0, 1, 2, 0, 1, 0]])


@pytest.mark.parametrize("name", TINY)
def test_packed_documents_do_not_see_each_other(name):
    model = zoo.Transformer(zoo.preset(name), key=jax.random.key(0))
    doc_a = jax.random.randint(jax.random.key(1), (1, 5), 0, 256)
    doc_b = jax.random.randint(jax.random.key(2), (1, 7), 0, 256)
    packed = jnp.concatenate([doc_a, doc_b], axis=1)
    seg = jnp.array([[1] * 5 + [2] * 7])
    logits = model(packed, segment_ids=seg)
    np.testing.assert_allclose(logits[:, :5], model(doc_a), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(logits[:, 5:], model(doc_b), rtol=1e-5, atol=1e-5)


def test_sliding_window_limits_context():
    config = zoo.preset("tiny-llama", sliding_window=3, n_layers=1)
    model = zoo.Transformer(config, key=jax.random.key(0))
    tokens = jax.random.randint(jax.random.key(1), (1, 8), 0, 256)
    changed = tokens.at[0, 0].set((tokens[0, 0] + 1) % 256)
    # With one layer and window 3, token 0 only influences positions 0..2.
    np.testing.assert_allclose(model(tokens)[:, 3:], model(changed)[:, 3:], rtol=1e-6)
    assert not np.allclose(model(tokens)[:, 2], model(changed)[:, 2])


@pytest.mark.parametrize("name", TINY)
def test_sequences_beyond_max_seq_len_are_refused(name):
    # Learned positions have no row past max_seq_len; rotary ones were not trained past it.
    model = zoo.Transformer(zoo.preset(name, max_seq_len=32), key=jax.random.key(0))
    with pytest.raises(ValueError, match="max_seq_len=32"):
        model(jnp.zeros((1, 33), jnp.int32))
    with pytest.raises(ValueError, match="max_seq_len=32"):
        model.init_cache(1, 33)


def test_tokens_must_be_integers_of_rank_two():
    model = zoo.Transformer(zoo.preset("tiny-llama"), key=jax.random.key(0))
    with pytest.raises(Exception, match="tokens"):
        model(jnp.zeros((2, 4), jnp.float32))
    with pytest.raises(Exception, match="tokens"):
        model(jnp.zeros((4,), jnp.int32))


# JAX 0.11 does not show a remat policy the names inside a custom_vjp's forward rule, so there
# "dots" still re-runs flash's forward kernel in the backward pass (JAX >= 0.12 keeps them).
DOTS_FORWARD_KERNELS = 1 if jax.__version_info__ >= (0, 12) else 2


@pytest.mark.parametrize(
    "remat, forward_kernels", [("none", 1), ("dots", DOTS_FORWARD_KERNELS), ("full", 2)]
)
def test_dots_remat_keeps_flash_residuals(remat, forward_kernels):
    # "dots" saves flash attention's output and log-sum-exp, so the backward pass reuses them
    # instead of re-running the forward kernel as "full" remat does; gradients are unchanged.
    config = zoo.preset("tiny-llama", n_layers=2)
    policy = zoo.Policy(attention="flash", remat=remat)
    model = zoo.Transformer(config, policy=policy, key=jax.random.key(0))
    tokens = jax.random.randint(jax.random.key(1), (1, 64), 0, 256)

    def loss(model):
        return jnp.mean(model(tokens) ** 2)

    grad = eqx.filter_grad(loss)
    assert str(eqx.filter_make_jaxpr(grad)(model)[0]).count("name=flash_forward") == forward_kernels
    reference = model.with_policy(remat="none")
    compiled = eqx.filter_jit(grad)  # one program, not op by op
    for a, b in zip(
        jax.tree.leaves(compiled(model)), jax.tree.leaves(compiled(reference)), strict=True
    ):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
