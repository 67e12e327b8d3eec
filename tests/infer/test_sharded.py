"""Sharded generate on 8 fake CPU devices: tensor-parallel and data-parallel weights and KV cache
give the same greedy tokens as one device."""

import jax
import pytest

import infer
import shard

PROMPTS = [[3, 1, 4, 1, 5, 9, 2], [2, 7], [1, 8, 2, 8], [6], [5, 3, 5], [8, 9], [7, 9, 3], [2]]


@pytest.mark.parametrize(
    "preset, sizes", [("tp", {"data": 4, "tensor": 2}), ("dp", {"data": 8})], ids=["tp", "dp"]
)
def test_sharded_greedy_equals_unsharded(model, preset, sizes):
    prompts = PROMPTS[: sizes["data"]]
    kwargs = {"max_new_tokens": 5, "sampler": infer.Greedy(), "key": jax.random.key(0)}
    expected = infer.generate(model, prompts, **kwargs)
    mesh = shard.mesh(**sizes)
    out = infer.generate(
        model, prompts, mesh=mesh, rules=shard.ShardingRules.preset(preset), **kwargs
    )
    assert out == expected


def test_sharded_generate_needs_mesh_and_rules(model):
    with pytest.raises(ValueError, match="both mesh and rules"):
        infer.generate(
            model, [[1, 2]], max_new_tokens=2, sampler=infer.Greedy(), key=jax.random.key(0),
            mesh=shard.mesh(data=8),
        )  # fmt: skip


def test_sharded_batch_must_divide_by_the_batch_axes(model):
    with pytest.raises(ValueError, match="batch"):
        infer.generate(
            model, PROMPTS[:3], max_new_tokens=2, sampler=infer.Greedy(), key=jax.random.key(0),
            mesh=shard.mesh(data=8), rules=shard.ShardingRules.preset("dp"),
        )  # fmt: skip
