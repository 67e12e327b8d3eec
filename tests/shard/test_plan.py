"""The plan printer's bytes per device equal those of the real shardings of a tiny model."""

import jax
import jax.numpy as jnp
import optax
import pytest

import shard
import zoo
from shard.plan import main, plan
from zoo.math import HARDWARE

# Naive attention: the cheapest kernel to compile (the kernels are tested elsewhere).
CONFIG = zoo.preset(
    "tiny-llama", n_heads=4, n_kv_heads=4, d_ff=128, vocab_size=256, attention="naive"
)
MESHES = {"fsdp": {"fsdp": 8}, "tp": {"data": 2, "tensor": 4}, "fsdp_tp": {"fsdp": 2, "tensor": 4}}


def bytes_per_device(tree) -> int:
    """The most bytes any one device holds of the arrays in `tree`."""
    held: dict = {}
    for array in jax.tree.leaves(tree):
        for piece in array.addressable_shards:
            held[piece.device] = held.get(piece.device, 0) + piece.data.nbytes
    return max(held.values())


@pytest.mark.parametrize("name", list(MESHES))
def test_plan_bytes_match_real_shardings(name):
    rules, mesh_shape = shard.ShardingRules.preset(name), MESHES[name]
    mesh = shard.mesh(**mesh_shape)
    p = plan(CONFIG, rules, mesh_shape, batch=8, seq=16, hardware=HARDWARE["h100"])

    # Placed rather than created sharded, to save a compile (tests/shard/test_init.py
    # covers init_sharded).
    model = shard.shard_model(zoo.Transformer(CONFIG, key=jax.random.key(0)), rules, mesh)
    assert p.params == bytes_per_device(model)
    state = shard.init_opt_state(optax.adam(1e-3), model, rules, mesh)
    assert p.adam_state == bytes_per_device(state)
    k = jnp.zeros((CONFIG.n_layers, 8, CONFIG.n_kv_heads, 16, CONFIG.head_dim))
    sharding = shard.named_sharding("layers batch kv_heads kv_seq head_dim", rules, mesh)
    assert p.kv_cache == 2 * bytes_per_device(jax.device_put(k, sharding))


def test_plan_lists_each_strategys_collectives():
    h100 = HARDWARE["h100"]
    kinds = {}
    for name, mesh_shape in MESHES.items():
        p = plan(
            CONFIG, shard.ShardingRules.preset(name), mesh_shape, batch=8, seq=16, hardware=h100
        )
        kinds[name] = {(c.name, c.axis) for c in p.collectives}
    assert kinds["fsdp"] == {("all-gather", "fsdp"), ("reduce-scatter", "fsdp")}
    assert kinds["tp"] == {("all-reduce", "data"), ("all-reduce", "tensor")}
    assert kinds["fsdp_tp"] == {
        ("all-gather", "fsdp"),
        ("reduce-scatter", "fsdp"),
        ("all-reduce", "tensor"),
    }


def test_cli_prints_the_table(capsys):
    main(["--model", "tiny-llama", "--mesh", "fsdp=4,tensor=2", "--batch", "8", "--seq", "64"])
    out = capsys.readouterr().out
    assert "rules fsdp_tp" in out and "reduce-scatter" in out and "hides?" in out
