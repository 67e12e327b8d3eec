"""Every parameter has logical axis names that match its rank; rules refuse conflicts."""

import equinox as eqx
import jax
import pytest

import zoo
from shard import LogicalAxes, ShardingRules, constrain, logical_axes

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


@pytest.mark.parametrize("name", ["tiny-gpt2", "tiny-llama"])
def test_every_parameter_is_named(name):
    model = zoo.Transformer(
        zoo.preset(name, qk_norm=True, tie_embeddings=False), key=jax.random.key(0)
    )
    params = jax.tree.leaves(eqx.filter(model, eqx.is_array))
    axes = jax.tree.leaves(logical_axes(model), is_leaf=lambda x: isinstance(x, LogicalAxes))
    assert len(axes) == len(params)
    for array, names in zip(params, axes, strict=True):
        assert len(names.names) == array.ndim
        assert set(names.names) <= VOCABULARY
    stacked = logical_axes(model).blocks.attn.q_proj.weight
    assert stacked.names == ("layers", "embed", "heads", "head_dim")


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
    assert specs == {
        "dp": jax.P(None, None, None),
        "fsdp": jax.P(None, "fsdp", None),
        "tp": jax.P(None, None, "tensor"),
        "fsdp_tp": jax.P(None, "fsdp", "tensor"),
    }
    ep = ShardingRules.preset("ep")
    assert ep.param_spec(("experts", "embed", "mlp")) == jax.P("expert", "fsdp", None)
    assert ep.partition_spec(("experts", "kv_seq", "embed")) == jax.P("expert", None, None)
    assert ep.partition_spec(("batch", "seq", "embed")) == jax.P(
        ("data", "fsdp", "expert"), None, None
    )
