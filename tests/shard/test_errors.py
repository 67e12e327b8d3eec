"""Bad inputs get a clear error before anything compiles."""

import jax
import numpy as np
import pytest

import shard
import zoo
from training.plan import plan
from zoo.math import HARDWARE

CONFIG = zoo.preset("tiny-llama", n_layers=1, n_heads=4, n_kv_heads=4, d_ff=128, vocab_size=256)


def test_mesh_size_must_match_device_count():
    with pytest.raises(ValueError, match="holds 4 devices but there are 8"):
        shard.mesh(fsdp=2, tensor=2)


def test_unknown_mesh_axis():
    with pytest.raises(ValueError, match=r"unknown mesh axis \['model'\]"):
        shard.mesh(model=8)
    with pytest.raises(ValueError, match="unknown mesh axis 'model'"):
        shard.parse_mesh("fsdp=4,model=2")
    with pytest.raises(ValueError, match="bad mesh entry 'fsdp'"):
        shard.parse_mesh("fsdp")
    with pytest.raises(ValueError, match="maps to unknown mesh axis 'model'"):
        shard.ShardingRules((("embed", "model"),))


def test_unknown_logical_axis():
    with pytest.raises(ValueError, match="unknown logical axis 'hidden'"):
        shard.ShardingRules((("hidden", "fsdp"),))
    with pytest.raises(ValueError, match="unknown logical axis 'hidden'"):
        shard.ShardingRules.preset("fsdp").partition_spec(("batch", "hidden"))
    with pytest.raises(ValueError, match="unknown sharding preset 'zero3'"):
        shard.ShardingRules.preset("zero3")


def test_two_logical_axes_on_one_mesh_axis():
    rules = shard.ShardingRules((("batch", "data"), ("embed", "fsdp"), ("mlp", "fsdp")))
    with pytest.raises(ValueError, match="'embed' and 'mlp' both map to mesh axis 'fsdp'"):
        rules.param_spec(("embed", "mlp"))


def test_indivisible_parameter_names_parameter_axis_and_sizes():
    config = CONFIG.replace(n_heads=2, n_kv_heads=2, head_dim=32)
    rules, mesh = shard.ShardingRules.preset("tp"), shard.mesh(data=2, tensor=4)
    message = (
        r"\.stacks\[0\]\.blocks\[0\]\.attn\.q_proj\.weight: dimension 'heads' of size 2 "
        r"does not divide by "
        r"mesh axis 'tensor' of size 4"
    )
    with pytest.raises(ValueError, match=message):
        shard.init_sharded(
            lambda key: zoo.Transformer(config, key=key), rules, mesh, jax.random.key(0)
        )
    with pytest.raises(ValueError, match=message):
        plan(config, zoo.Policy(), rules, {"data": 2, "tensor": 4}, batch=8, seq=8,
             hardware=HARDWARE["h100"])  # fmt: skip


def test_indivisible_batch():
    rules, mesh = shard.ShardingRules.preset("dp"), shard.mesh(data=8)
    with pytest.raises(ValueError, match="dimension 'batch' of size 6 does not divide"):
        shard.shard_batch(np.zeros((6, 4), np.int32), rules, mesh)


def test_rules_need_their_mesh_axes():
    mesh = jax.make_mesh((8,), ("fsdp",), axis_types=(jax.sharding.AxisType.Auto,))
    with pytest.raises(ValueError, match="mesh axis 'data', which this mesh"):
        shard.named_sharding("batch seq", shard.ShardingRules.preset("dp"), mesh)


def test_constrain_checks_rank():
    rules, mesh = shard.ShardingRules.preset("dp"), shard.mesh(data=8)
    with shard.use_rules(rules, mesh), pytest.raises(ValueError, match="names 2 dims"):
        shard.constrain(jax.numpy.ones((8, 2, 3)), "batch embed")
