"""MoE models: config checks, parameter counts (total and active), interleaved stacks, the typed
forward output, equivalence with a dense model, compile size."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import shard
import zoo
from zoo import Config

TOKENS = jax.random.randint(jax.random.key(1), (2, 10), 0, 256)
# Leading dense layer, then groups of (dense, MoE): MoE layers 2 and 4, shared experts, capacity.
INTERLEAVED = zoo.preset("tiny-deepseek-moe", n_layers=5, moe_every=2, moe_dispatch="capacity")


def shapes_of(config):
    """The model's parameter shapes without computing any weights."""
    return eqx.filter_eval_shape(zoo.Transformer, config, key=jax.random.key(0))


def is_shape(x):
    return isinstance(x, jax.ShapeDtypeStruct)


@pytest.fixture(scope="module")
def interleaved():
    return zoo.Transformer(INTERLEAVED, key=jax.random.key(0))


@pytest.fixture(scope="module")
def dense():
    return zoo.Transformer(zoo.preset("tiny-llama"), key=jax.random.key(0))


def test_published_moe_parameter_counts():
    mixtral = zoo.preset("mixtral-8x7b")
    assert zoo.math.param_count(mixtral) == pytest.approx(46.7e9, rel=2e-3)
    assert zoo.math.active_param_count(mixtral) == pytest.approx(12.9e9, rel=2e-3)
    deepseek = zoo.preset("deepseek-moe-16b")
    assert zoo.math.param_count(deepseek) == pytest.approx(16.4e9, rel=3e-3)
    assert zoo.math.active_param_count(deepseek) == pytest.approx(2.8e9, rel=2e-2)
    assert deepseek.moe_layers == tuple(range(1, 28))


@pytest.mark.parametrize(
    ("name", "changes"),
    [
        ("tiny-moe", {}),
        ("tiny-moe", {"moe_dispatch": "capacity", "n_shared_experts": 2}),
        ("tiny-moe", {"n_layers": 5, "moe_every": 2, "first_dense_layers": 1}),
        ("tiny-deepseek-moe", {}),
        ("tiny-deepseek-moe", {"n_layers": 7, "moe_every": 3}),
    ],
)
def test_param_count_matches_leaves(name, changes):
    config = zoo.preset(name, **changes)
    leaves = jax.tree.leaves(eqx.filter(shapes_of(config), is_shape))
    assert sum(x.size for x in leaves) == zoo.math.param_count(config)
    expert_params = 3 * config.d_model * config.expert_d_ff
    unused = (config.n_experts - config.n_experts_per_token) * expert_params
    active = zoo.math.param_count(config) - len(config.moe_layers) * unused
    assert zoo.math.active_param_count(config) == active


def test_moe_layer_positions():
    config = zoo.preset("tiny-moe", n_layers=7, moe_every=3, first_dense_layers=1)
    assert config.moe_layers == (3, 6)
    assert zoo.preset("tiny-llama").moe_layers == ()


def test_forward_returns_logits_and_per_layer_stats(interleaved):
    config, model = INTERLEAVED, interleaved
    out = model.forward(TOKENS)
    assert isinstance(out, zoo.ModelOutput)
    assert out.logits.shape == (2, 10, 256)
    assert out.aux.expert_load.shape == (2, config.n_experts)
    np.testing.assert_allclose(out.aux.expert_load.sum(-1), 1.0, rtol=1e-6)
    assert out.aux.load_balancing_loss.shape == (2,) and out.aux.z_loss.shape == (2,)
    np.testing.assert_array_equal(model(TOKENS), out.logits)
    loss = zoo.moe_aux_loss(out.aux, config)
    expected = np.mean(
        config.moe_load_balancing_weight * out.aux.load_balancing_loss
        + config.moe_z_loss_weight * out.aux.z_loss
    )
    np.testing.assert_allclose(loss, expected, rtol=1e-6)


def test_dense_model_has_empty_stats_and_zero_aux_loss(dense):
    config = dense.config
    out = dense.forward(TOKENS)
    assert out.aux.load_balancing_loss.shape == (0,)
    assert float(zoo.moe_aux_loss(out.aux, config)) == 0.0


@pytest.mark.parametrize("dispatch", ["dropless", "capacity"])
def test_one_expert_equals_the_dense_model(dense, dispatch):
    moe_config = dense.config.replace(
        n_experts=1, n_experts_per_token=1, moe_dispatch=dispatch, capacity_factor=1.0
    )
    # The MoE model's structure, filled with the dense model's weights: each layer's SwiGLU
    # becomes expert 0 and the router (softmax over one expert: gate 1) is random.
    moe = shapes_of(moe_config)
    mlp = dense.blocks.mlp
    router = jax.random.normal(jax.random.key(3), moe.blocks.mlp.router.weight.shape)
    moe = eqx.tree_at(
        lambda m: (
            m.embed,
            m.lm_head,
            m.final_norm,
            m.blocks.attn,
            m.blocks.attn_norm,
            m.blocks.mlp_norm,
            m.blocks.mlp.experts.gate,
            m.blocks.mlp.experts.up,
            m.blocks.mlp.experts.down,
            m.blocks.mlp.router.weight,
        ),
        moe,
        (
            dense.embed,
            dense.lm_head,
            dense.final_norm,
            dense.blocks.attn,
            dense.blocks.attn_norm,
            dense.blocks.mlp_norm,
            mlp.gate.weight[:, None],
            mlp.up.weight[:, None],
            mlp.down.weight[:, None],
            router,
        ),
    )
    assert not jax.tree.leaves(eqx.filter(moe, is_shape))
    np.testing.assert_allclose(moe(TOKENS), dense(TOKENS), rtol=1e-5, atol=1e-5)


def test_interleaved_scan_equals_unrolled_loop(interleaved):
    scanned = zoo.with_runtime(interleaved, remat="full")
    unrolled = zoo.with_runtime(interleaved, remat="full", scan_layers=False)
    config = scanned.config
    a, b = scanned.forward(TOKENS), unrolled.forward(TOKENS)
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_allclose(x, y, rtol=1e-5, atol=1e-5)

    def loss(model):
        out = model.forward(TOKENS)
        return jnp.mean(out.logits**2) + zoo.moe_aux_loss(out.aux, config)

    grads = eqx.filter_grad(loss)(scanned)
    # The aux loss reaches every MoE layer's router through the scanned stack.
    router_grads = np.abs(np.asarray(grads.blocks.moe.mlp.router.weight))
    assert (router_grads.max(axis=(1, 2)) > 0).all()


def hlo_size(n_layers: int) -> int:
    config = zoo.preset("tiny-moe", n_layers=n_layers, moe_every=2, first_dense_layers=1)
    weights, static = eqx.partition(shapes_of(config), is_shape)
    forward = jax.jit(lambda w, t: eqx.combine(w, static).forward(t))
    return len(forward.lower(weights, jax.ShapeDtypeStruct((1, 8), jnp.int32)).as_text())


def test_program_size_does_not_grow_with_depth():
    # 2 groups of (dense, MoE) vs 6: the scanned stack keeps one copy of each.
    # (Stack sizes differ from the one leading dense layer's, so no helper is shared by chance.)
    five, thirteen = hlo_size(5), hlo_size(13)
    assert abs(thirteen - five) / five < 0.02


def test_expert_weights_name_experts_first():
    model = zoo.Transformer(zoo.preset("tiny-deepseek-moe"), key=jax.random.key(0))
    axes = shard.logical_axes(model)
    assert axes.blocks.mlp.experts.gate.names == ("layers", "experts", "embed", "mlp")
    assert axes.blocks.mlp.router.weight.names == ("layers", "embed", "experts")
    assert axes.dense_blocks.mlp.up.weight.names == ("layers", "embed", "mlp")


def base(**changes):
    fields = dict(
        vocab_size=64, d_model=32, n_layers=4, n_heads=4, d_ff=64, max_seq_len=16, n_experts=4
    )
    fields.update(changes)
    return Config(**fields)


@pytest.mark.parametrize(
    ("changes", "field"),
    [
        ({"n_experts_per_token": 5}, "n_experts_per_token"),
        ({"n_experts_per_token": 0}, "n_experts_per_token"),
        ({"capacity_factor": 0.0}, "capacity_factor"),
        ({"capacity_factor": -1.0}, "capacity_factor"),
        ({"moe_dispatch": "sorted"}, "moe_dispatch"),
        ({"router_scoring": "relu"}, "router_scoring"),
        ({"n_experts": -1}, "n_experts"),
        ({"n_shared_experts": -1}, "n_shared_experts"),
        ({"moe_d_ff": 0}, "moe_d_ff"),
        ({"moe_every": 3}, "moe_every"),
        ({"moe_every": 0}, "moe_every"),
        ({"first_dense_layers": 4}, "first_dense_layers"),
        ({"mlp": "gelu"}, "mlp"),
        ({"moe_z_loss_weight": -0.1}, "moe_z_loss_weight"),
    ],
)
def test_impossible_moe_configs_name_the_field(changes, field):
    with pytest.raises(ValueError, match=f"Config.{field}"):
        base(**changes)


def test_capacity_dispatch_flops():
    config = zoo.preset("tiny-moe", moe_dispatch="capacity", capacity_factor=1.0)
    seq = 64
    # capacity = 64 x 2 / 4 = 32 slots per expert: 4 x 32 slots per 64 tokens = k, no padding;
    # the dispatch and combine einsums each do experts x capacity x d_model MACs per token.
    per_layer = 2 * (2 * 4 * 32 * config.d_model)
    assert zoo.math.capacity_dispatch_flops_per_token(config, seq) == 2 * per_layer
    padded = config.replace(capacity_factor=2.0)
    expert_flops = 2 * 3 * config.d_model * config.expert_d_ff
    extra = zoo.math.capacity_dispatch_flops_per_token(padded, seq)
    assert extra == 2 * (2 * per_layer + 2 * expert_flops)
    assert zoo.math.capacity_dispatch_flops_per_token(zoo.preset("tiny-llama"), seq) == 0
