"""MoE models: config checks, parameter counts (total and active), interleaved stacks, the typed
forward output, equivalence with a dense model, compile size."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import shard
import zoo
from layers.moe import Capacity, aux_loss
from training.loss import AuxWeights
from zoo import Config

TOKENS = jax.random.randint(jax.random.key(1), (2, 10), 0, 256)
# Leading dense layer, then groups of (dense, MoE): MoE layers 2 and 4, shared experts, capacity.
INTERLEAVED = zoo.preset("tiny-deepseek-moe", n_layers=5, moe_every=2)
CAPACITY = zoo.Policy(moe_dispatch="capacity")
WEIGHTS = AuxWeights()


def weighted_aux(aux):
    return aux_loss(aux, load_balancing_weight=WEIGHTS.load_balancing, z_loss_weight=WEIGHTS.z_loss)


def shapes_of(config, policy=CAPACITY):
    """The model's parameter shapes without computing any weights."""
    return eqx.filter_eval_shape(zoo.Transformer, config, policy=policy, key=jax.random.key(0))


def is_shape(x):
    return isinstance(x, jax.ShapeDtypeStruct)


@pytest.fixture(scope="module")
def interleaved():
    return zoo.Transformer(INTERLEAVED, policy=CAPACITY, key=jax.random.key(0))


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
        ("tiny-moe", {"n_shared_experts": 2}),
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
    loss = weighted_aux(out.aux)
    expected = np.mean(
        WEIGHTS.load_balancing * out.aux.load_balancing_loss + WEIGHTS.z_loss * out.aux.z_loss
    )
    np.testing.assert_allclose(loss, expected, rtol=1e-6)


def test_dense_model_has_empty_stats_and_zero_aux_loss(dense):
    out = dense.forward(TOKENS)
    assert out.aux.load_balancing_loss.shape == (0,)
    assert float(weighted_aux(out.aux)) == 0.0


@pytest.mark.parametrize("dispatch", ["dropless", "capacity"])
def test_one_expert_equals_the_dense_model(dense, dispatch):
    moe_config = dense.config.replace(n_experts=1, n_experts_per_token=1)
    policy = zoo.Policy(moe_dispatch=Capacity(1.0) if dispatch == "capacity" else "dropless")
    # The MoE model's structure, filled with the dense model's weights: each layer's SwiGLU
    # becomes expert 0 and the router (softmax over one expert: gate 1) is random.
    moe = shapes_of(moe_config, policy)
    block = dense.stacks[0].blocks[0]
    mlp = block.mlp
    moe_block = lambda m: m.stacks[0].blocks[0]  # noqa: E731
    router = jax.random.normal(jax.random.key(3), moe_block(moe).mlp.router.weight.shape)
    moe = eqx.tree_at(
        lambda m: (
            m.embed,
            m.lm_head,
            m.final_norm,
            moe_block(m).attn,
            moe_block(m).attn_norm,
            moe_block(m).mlp_norm,
            moe_block(m).mlp.experts.gate,
            moe_block(m).mlp.experts.up,
            moe_block(m).mlp.experts.down,
            moe_block(m).mlp.router.weight,
        ),
        moe,
        (
            dense.embed,
            dense.lm_head,
            dense.final_norm,
            block.attn,
            block.attn_norm,
            block.mlp_norm,
            mlp.gate.weight[:, None],
            mlp.up.weight[:, None],
            mlp.down.weight[:, None],
            router,
        ),
    )
    assert not jax.tree.leaves(eqx.filter(moe, is_shape))
    np.testing.assert_allclose(moe(TOKENS), dense(TOKENS), rtol=1e-5, atol=1e-5)


def test_interleaved_scan_equals_unrolled_loop(interleaved):
    scanned = interleaved.with_policy(remat="full")
    unrolled = interleaved.with_policy(remat="full", scan_layers=False)
    forward = eqx.filter_jit(lambda model: model.forward(TOKENS))  # one program, not op by op
    a, b = forward(scanned), forward(unrolled)
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_allclose(x, y, rtol=1e-5, atol=1e-5)

    def loss(model):
        out = model.forward(TOKENS)
        return jnp.mean(out.logits**2) + weighted_aux(out.aux)

    grads = eqx.filter_jit(eqx.filter_grad(loss))(scanned)
    # The aux loss reaches every MoE layer's router through the scanned stack of
    # (dense, MoE) periods.
    router_grads = np.abs(np.asarray(grads.stacks[1].blocks[1].mlp.router.weight))
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
    moe, leading = axes.stacks[1].blocks[0], axes.stacks[0].blocks[0]
    assert moe.mlp.experts.gate.names == ("layers", "experts", "embed", "mlp")
    assert moe.mlp.router.weight.names == ("layers", "embed", "experts")
    assert leading.mlp.up.weight.names == ("layers", "embed", "mlp")


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
        ({"router_scoring": "relu"}, "router_scoring"),
        ({"n_experts": -1}, "n_experts"),
        ({"n_shared_experts": -1}, "n_shared_experts"),
        ({"moe_d_ff": 0}, "moe_d_ff"),
        ({"moe_every": 3}, "moe_every"),
        ({"moe_every": 0}, "moe_every"),
        ({"first_dense_layers": 4}, "first_dense_layers"),
        ({"mlp": "gelu"}, "mlp"),
    ],
)
def test_impossible_moe_configs_name_the_field(changes, field):
    with pytest.raises(ValueError, match=f"Config.{field}"):
        base(**changes)


def test_capacity_dispatch_flops():
    config = zoo.preset("tiny-moe")
    seq = 64
    # capacity = 64 x 2 / 4 = 32 slots per expert: 4 x 32 slots per 64 tokens = k, no padding;
    # the dispatch and combine einsums each do experts x capacity x d_model MACs per token.
    per_layer = 2 * (2 * 4 * 32 * config.d_model)
    assert zoo.math.capacity_dispatch_flops_per_token(config, seq, 1.0) == 2 * per_layer
    expert_flops = 2 * 3 * config.d_model * config.expert_d_ff
    extra = zoo.math.capacity_dispatch_flops_per_token(config, seq, 2.0)
    assert extra == 2 * (2 * per_layer + 2 * expert_flops)
    assert zoo.math.capacity_dispatch_flops_per_token(zoo.preset("tiny-llama"), seq, 1.0) == 0


@pytest.mark.parametrize(
    ("policy", "message"),
    [
        ({"moe_dispatch": "sorted"}, r"Policy\.moe_dispatch='sorted' is unknown"),
        ({"attention": "fast"}, "unknown attention kernel 'fast'"),
        ({"remat": "some"}, r"Policy\.remat='some' is unknown"),
        ({"compute_dtype": "int8"}, r"Policy\.compute_dtype='int8' is unknown"),
    ],
)
def test_impossible_policies_name_the_field(policy, message):
    with pytest.raises(ValueError, match=message):
        zoo.Policy(**policy)
    with pytest.raises(ValueError, match="capacity_factor must be > 0"):
        Capacity(0.0)
    with pytest.raises(ValueError, match=r"AuxWeights\.z_loss must be finite and >= 0"):
        AuxWeights(z_loss=-0.1)
