"""Sharded generate on 8 fake CPU devices: tensor-parallel and data-parallel weights and paged KV
cache (or sliding layers' rings) give the same greedy tokens as one device."""

import dataclasses

import jax
import pytest

import infer
import shard
from tests.zoo.random_model import random_model

PROMPTS = [[3, 1, 4, 1, 5, 9, 2], [2, 7], [1, 8, 2, 8], [6], [5, 3, 5], [8, 9], [7, 9, 3], [2]]


@pytest.mark.parametrize(
    "preset, sizes", [("tp", {"data": 4, "tensor": 2}), ("dp", {"data": 8})], ids=["tp", "dp"]
)
def test_sharded_greedy_equals_unsharded(model, preset, sizes):
    if model.config.position == "rope":  # Llama with a 4-token window: every layer a ring
        model = random_model(dataclasses.replace(model.config, sliding_window=4), 0)
    prompts = PROMPTS[: sizes["data"]]
    kwargs = {"max_new_tokens": 5, "sampler": infer.Greedy(), "key": jax.random.key(0)}
    expected = infer.generate(model, prompts, **kwargs)
    placement = shard.Placement(shard.mesh(**sizes), shard.ShardingRules.preset(preset))
    sharded = placement.place(model)
    out = infer.generate(sharded, prompts, placement=placement, **kwargs)
    assert out == expected
    # The pools (the rings, for the windowed Llama) are split as the rules split K/V heads (tp)
    # or rows (dp), and the weights stay where they are.
    engine = infer.Engine(
        sharded, max_batch=len(prompts), max_len=64, placement=placement, warm_up=False
    )
    pool = engine.state.pages[0][0].k
    expected_sharding = placement.array_shardings(engine.state.pages)[0][0].k
    assert pool.sharding.is_equivalent_to(expected_sharding, pool.ndim)


def test_sharded_batch_must_divide_by_the_batch_axes(model):
    with pytest.raises(ValueError, match="batch"):
        infer.generate(
            model, PROMPTS[:3], max_new_tokens=2, sampler=infer.Greedy(), key=jax.random.key(0),
            placement=shard.Placement(shard.mesh(data=8), shard.ShardingRules.preset("dp")),
        )  # fmt: skip
