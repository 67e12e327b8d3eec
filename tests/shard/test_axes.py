"""Every parameter has logical axis names that match its rank; rules refuse conflicts."""

import equinox as eqx
import jax
import pytest

import zoo
from shard import LogicalAxes, ShardingRules, constrain, logical_axes
from shard.axes import is_array_like

VOCABULARY = {
    "batch",
    "seq",
    "kv_seq",
    "embed",
    "heads",
    "kv_heads",
    "head_dim",
    "mlp",
    "vocab",
    "experts",
    "layers",
}


@pytest.mark.parametrize("name", ["tiny-gpt2", "tiny-llama", "tiny-deepseek-moe"])
def test_every_parameter_is_named(name):
    # Abstract (no weights computed): the names depend on shapes only.
    model = eqx.filter_eval_shape(
        zoo.Transformer, zoo.preset(name, qk_norm=True, tie_embeddings=False), key=jax.random.key(0)
    )
    params = jax.tree.leaves(eqx.filter(model, is_array_like))
    axes = jax.tree.leaves(logical_axes(model), is_leaf=lambda x: isinstance(x, LogicalAxes))
    assert len(axes) == len(params)
    for array, names in zip(params, axes, strict=True):
        assert len(names.names) == array.ndim
        assert set(names.names) <= VOCABULARY
    last = logical_axes(model).stacks[-1].blocks[-1]  # the last stack's period ends with MoE
    assert last.attn.q_proj.weight.names == ("layers", "embed", "heads", "head_dim")
    if model.config.n_experts:
        experts = last.mlp.experts
        assert experts.gate.names == ("layers", "experts", "embed", "mlp")
        assert experts.down.names == ("layers", "experts", "mlp", "embed")


def test_expert_buffer_takes_batch_axes_left_by_experts():
    # Under ep, `batch` and `experts` share the `expert` mesh axis: one activation cannot carry
    # both, so the capacity buffer names its sequence dim `expert_batch`.
    ep = ShardingRules.preset("ep")
    with pytest.raises(ValueError, match="'experts' and 'batch' both map to mesh axis 'expert'"):
        ep.partition_spec(("experts", "batch", "capacity", "embed"))
    buffer = ("experts", "expert_batch", "capacity", "embed")
    assert ep.partition_spec(buffer) == jax.P("expert", ("data", "fsdp"), None, None)
    # Without expert parallelism the buffer keeps the batch's sharding (no communication).
    assert ShardingRules.preset("fsdp").partition_spec(buffer) == jax.P(
        None, ("data", "fsdp", "expert"), None, None
    )
    # Rules may map it themselves; an empty remainder is replicated.
    assert ShardingRules((("batch", "expert"), ("experts", "expert"))).partition_spec(
        buffer
    ) == jax.P("expert", None, None, None)
    own = ShardingRules((("experts", "expert"), ("expert_batch", "data")))
    assert own.partition_spec(buffer) == jax.P("expert", "data", None, None)


def test_rules_refuse_two_axes_on_one_mesh_axis():
    rules = ShardingRules((("embed", "fsdp"), ("mlp", "fsdp")))
    with pytest.raises(ValueError, match="'embed' and 'mlp' both map to mesh axis 'fsdp'"):
        rules.partition_spec(("embed", "mlp"))


def test_constrain_without_rules_is_identity():
    x = jax.numpy.ones((2, 3))
    assert constrain(x, "batch embed") is x


def test_presets_map_the_strategy_axes():
    specs = {
        name: ShardingRules.preset(name).param_spec(("layers", "embed", "mlp"))
        for name in ("dp", "fsdp", "tp", "fsdp_tp")
    }
    # Every preset splits the stacked layer axis over `pipeline` (a no-op where it has size 1).
    assert specs == {
        "dp": jax.P("pipeline", None, None),
        "fsdp": jax.P("pipeline", "fsdp", None),
        "tp": jax.P("pipeline", None, "tensor"),
        "fsdp_tp": jax.P("pipeline", "fsdp", "tensor"),
    }
    ep = ShardingRules.preset("ep")
    assert ep.param_spec(("experts", "embed", "mlp")) == jax.P("expert", "fsdp", None)
    assert ep.partition_spec(("experts", "kv_seq", "embed")) == jax.P("expert", None, None)
    assert ep.partition_spec(("batch", "seq", "embed")) == jax.P(
        ("data", "fsdp", "expert"), None, None
    )
