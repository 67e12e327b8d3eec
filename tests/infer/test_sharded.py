"""Sharded generate on 8 fake CPU devices: tensor-parallel and data-parallel weights and paged KV
cache (or sliding layers' rings) give the same greedy tokens as one device."""

import dataclasses

import jax
import pytest

import infer
import shard
from tests.zoo.random_model import random_model

PROMPTS = [[3, 1, 4, 1, 5, 9, 2], [2, 7], [1, 8, 2, 8], [6], [5, 3, 5], [8, 9], [7, 9, 3], [2]]


GREEDY = {"max_new_tokens": 5, "sampler": infer.Greedy(), "key": jax.random.key(0)}


@pytest.fixture(scope="module")
def unsharded(model):
    """The model the sharded runs take (Llama with a 4-token window, so that every layer is a
    ring) and its greedy tokens on one device, computed once for both presets."""
    if model.config.position == "rope":
        model = random_model(dataclasses.replace(model.config, sliding_window=4), 0)
    return model, infer.generate(model, PROMPTS, **GREEDY)


@pytest.mark.parametrize(
    "preset, sizes", [("tp", {"data": 4, "tensor": 2}), ("dp", {"data": 8})], ids=["tp", "dp"]
)
def test_sharded_greedy_equals_unsharded(unsharded, preset, sizes):
    model, expected = unsharded
    placement = shard.Placement(shard.mesh(**sizes), shard.ShardingRules.preset(preset))
    sharded = placement.place(model)
    assert infer.generate(sharded, PROMPTS, placement=placement, **GREEDY) == expected
    # The pools (the rings, for the windowed Llama) are split as the rules split K/V heads (tp)
    # or rows (dp), and the weights stay where they are.
    engine = infer.Engine(
        sharded, max_batch=len(PROMPTS), max_len=64, placement=placement, warm_up=False
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
