"""load_pretrained with a mesh: every weight lands in the sharding `shard.param_shardings` gives
it, and the sharded model computes the same logits as the unsharded load (8 fake CPU devices)."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import shard
import zoo
from shard import ShardingRules
from tests.zoo.random_model import random_model

_SMALL = {"vocab_size": 96, "d_model": 32, "d_ff": 48, "n_layers": 2, "max_seq_len": 32}
CASES = {
    # FSDP over `embed` and Megatron over heads / mlp / vocab at once.
    "llama-fsdp_tp": (zoo.preset("tiny-llama", **_SMALL), "fsdp_tp", {"fsdp": 4, "tensor": 2}),
    # Experts split over the `expert` axis.
    "mixtral-ep": (
        zoo.preset("tiny-moe", **_SMALL, moe_d_ff=None),
        "ep",
        {"expert": 4, "fsdp": 2},
    ),
}
TOKENS = jnp.asarray(np.random.default_rng(0).integers(0, 96, (2, 8)))
forward = eqx.filter_jit(lambda model, tokens: model(tokens))


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    out = tmp_path_factory.mktemp("sharded")
    for i, (name, (config, _, _)) in enumerate(CASES.items()):
        zoo.save_pretrained(random_model(config, i), out / name)
    return out


@pytest.mark.parametrize("name", list(CASES))
def test_each_weight_is_placed_in_its_sharding(checkpoints, name):
    _, preset, sizes = CASES[name]
    mesh, rules = shard.mesh(**sizes), ShardingRules.preset(preset)
    sharded = zoo.load_pretrained(checkpoints / name, placement=shard.Placement(mesh, rules))
    # The decode storage of a mesh (one array per layer) differs from one device's (stacked).
    plain = zoo.load_pretrained(checkpoints / name).with_policy(storage=sharded.policy.storage)
    expected = shard.param_shardings(plain, rules, mesh)
    leaves = jax.tree.leaves(eqx.filter(sharded, eqx.is_array))
    wanted = jax.tree.leaves(expected, is_leaf=lambda x: isinstance(x, jax.sharding.Sharding))
    assert len(leaves) == len(wanted) == len(jax.tree.leaves(plain))
    for array, sharding in zip(leaves, wanted, strict=True):
        assert array.sharding.is_equivalent_to(sharding, array.ndim)
    # The rules split something: this test would not notice a replicated load otherwise.
    assert sum(not a.sharding.is_fully_replicated for a in leaves) >= len(leaves) // 2
    for a, b in zip(jax.tree.leaves(plain), leaves, strict=True):
        np.testing.assert_array_equal(a, b)
    reference = forward(plain, TOKENS)
    with shard.use_rules(rules, mesh):
        ours = forward(sharded, TOKENS)
    np.testing.assert_allclose(ours, reference, rtol=1e-5, atol=1e-5)


def test_mesh_and_rules_go_together():
    with pytest.raises(ValueError, match="needs both a mesh and sharding rules"):
        shard.Placement(shard.mesh(fsdp=8))


def test_a_dimension_that_does_not_divide_is_named(checkpoints):
    # 4 heads over a tensor axis of 8.
    with pytest.raises(ValueError, match=r"q_proj.*'heads' of size 4 does not divide"):
        zoo.load_pretrained(
            checkpoints / "llama-fsdp_tp",
            placement=shard.Placement(shard.mesh(tensor=8), ShardingRules.preset("tp")),
        )
