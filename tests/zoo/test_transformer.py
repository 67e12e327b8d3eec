"""The assembled Transformer: shapes, parameter counts, scan == unrolled, compile size, errors."""

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
    config = zoo.preset("tiny-llama", dtype="bfloat16")
    model = zoo.Transformer(config, key=jax.random.key(0))
    assert model.embed.weight.dtype == jnp.float32
    assert model(jnp.zeros((1, 4), jnp.int32)).dtype == jnp.bfloat16


@pytest.mark.parametrize("name", TINY)
@pytest.mark.parametrize("remat", ["none", "full", "dots"])
def test_scan_equals_unrolled_loop(name, remat):
    config = zoo.preset(name, n_layers=3, remat=remat)
    scanned = zoo.Transformer(config, key=jax.random.key(0))
    unrolled = zoo.Transformer(config.replace(scan_layers=False), key=jax.random.key(0))
    tokens = jax.random.randint(jax.random.key(1), (2, 10), 0, 256)
    np.testing.assert_allclose(scanned(tokens), unrolled(tokens), rtol=1e-5, atol=1e-5)

    def loss(model):
        return jnp.mean(model(tokens) ** 2)

    g_scan = jax.tree.leaves(eqx.filter_grad(loss)(scanned))
    g_loop = jax.tree.leaves(eqx.filter_grad(loss)(unrolled))
    for a, b in zip(g_scan, g_loop, strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)


def hlo_size(n_layers: int) -> int:
    model = zoo.Transformer(zoo.preset("tiny-llama", n_layers=n_layers), key=jax.random.key(0))
    tokens = jnp.zeros((1, 8), jnp.int32)
    return len(eqx.filter_jit(lambda m, t: m(t)).lower(model, tokens).as_text())


def test_program_size_does_not_grow_with_depth():
    # Compile time follows program size; a scanned stack keeps one copy of the block.
    two, eight = hlo_size(2), hlo_size(8)
    assert abs(eight - two) / two < 0.02


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


def test_learned_positions_reject_long_sequences():
    model = zoo.Transformer(zoo.preset("tiny-gpt2"), key=jax.random.key(0))
    with pytest.raises(ValueError, match="max_seq_len"):
        model(jnp.zeros((1, 129), jnp.int32))


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
    config = zoo.preset("tiny-llama", n_layers=2, attention="flash", remat=remat)
    model = zoo.Transformer(config, key=jax.random.key(0))
    tokens = jax.random.randint(jax.random.key(1), (1, 64), 0, 256)

    def loss(model):
        return jnp.mean(model(tokens) ** 2)

    grad = eqx.filter_grad(loss)
    assert str(eqx.filter_make_jaxpr(grad)(model)[0]).count("name=flash_forward") == forward_kernels
    reference = zoo.Transformer(config.replace(remat="none"), key=jax.random.key(0))
    for a, b in zip(jax.tree.leaves(grad(model)), jax.tree.leaves(grad(reference)), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
