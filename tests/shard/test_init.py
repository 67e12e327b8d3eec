"""Sharded init: the model is created in its shardings, each device computing only its own
shards, and the values are those of the ordinary (unsharded) init."""

import math
import re

import equinox as eqx
import jax
import numpy as np
import pytest

import shard
import zoo
from shard.params import sharded_initialiser

KEY = jax.random.key(3)

CONFIG = zoo.preset("tiny-llama", n_layers=1, n_heads=4, n_kv_heads=4, d_ff=128, vocab_size=256)
# Without LLVM's optimisations: most of the CPU compile time, the same buffers. Floats can differ
# in the last bit from an optimised build (multiply-adds fused or not): compare like with like.
FAST_COMPILE = {"xla_backend_optimization_level": 0}


def one_device_init(key):
    """The ordinary initialiser on one device, jitted (cheaper than running it op by op)."""
    init = jax.jit(lambda key: eqx.filter(zoo.Transformer(CONFIG, key=key), eqx.is_array))
    params = init.lower(key).compile(FAST_COMPILE)(key)
    static = eqx.partition(eqx.filter_eval_shape(zoo.Transformer, CONFIG, key=key), eqx.is_array)
    return eqx.combine(params, static[1])


@pytest.fixture(scope="module")
def initialiser():
    """The fsdp_tp initialiser of CONFIG (every large parameter split 8 ways), compiled once."""
    rules, mesh, key = shard.ShardingRules.preset("fsdp_tp"), shard.mesh(fsdp=2, tensor=4), KEY
    abstract = eqx.filter_eval_shape(zoo.Transformer, CONFIG, key=key)
    shardings = shard.param_shardings(abstract, rules, mesh)
    make = lambda key: zoo.Transformer(CONFIG, key=key)  # noqa: E731
    lowered = sharded_initialiser(make, shardings).lower(key)
    return abstract, shardings, lowered.compile(FAST_COMPILE)


def test_no_device_ever_holds_a_whole_parameter(initialiser):
    abstract, shardings, compiled = initialiser
    params = jax.tree.leaves(eqx.filter(abstract, shard.axes.is_array_like))
    specs = jax.tree.leaves(shardings)
    largest_param = max(math.prod(p.shape) for p in params)
    shard_sizes = [math.prod(s.shard_shape(p.shape)) for p, s in zip(params, specs, strict=True)]
    # The largest parameters are split 8 ways.
    assert max(shard_sizes) * 8 == largest_param

    # No buffer of the per-device program (outputs, temporaries, RNG bits) is as large as the
    # largest parameter: each device builds shards only.
    sizes = [
        math.prod(int(d) for d in dims.split(",") if d)
        for dims in re.findall(r"[a-z]+\d+\[([\d,]*)\]", compiled.as_text())
    ]
    assert max(sizes) <= max(shard_sizes) < largest_param
    memory = compiled.memory_analysis()
    # The outputs are the shards (plus the output tuple's table of 8-byte pointers).
    shard_bytes = sum(4 * n for n in shard_sizes)
    assert shard_bytes <= memory.output_size_in_bytes <= shard_bytes + 8 * (len(params) + 1)
    assert memory.temp_size_in_bytes < 4 * largest_param


def test_sharded_init_equals_unsharded_init(initialiser):
    # `init_sharded` is this initialiser (compiled without the test's options) combined with
    # the static fields; tests/training/test_multiprocess.py runs it across processes.
    abstract, _, compiled = initialiser
    static = eqx.partition(abstract, shard.axes.is_array_like)[1]
    sharded = eqx.combine(compiled(KEY), static)
    plain = one_device_init(KEY)
    assert plain.stacks[0].blocks[0].mlp.up.weight.sharding.num_devices == 1
    assert sharded.stacks[0].blocks[0].mlp.up.weight.sharding.spec == jax.P(
        "pipeline", "fsdp", "tensor"
    )
    for a, b in zip(
        jax.tree.leaves(eqx.filter(sharded, eqx.is_array)),
        jax.tree.leaves(eqx.filter(plain, eqx.is_array)),
        strict=True,
    ):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_shard_model_places_an_existing_model():
    rules, mesh = shard.ShardingRules.preset("tp"), shard.mesh(data=2, tensor=4)
    plain = one_device_init(jax.random.key(1))
    placed = shard.shard_model(plain, rules, mesh)
    assert placed.lm_head.weight.sharding.spec == jax.P(None, "tensor")
    o_proj = placed.stacks[0].blocks[0].attn.o_proj.weight
    assert o_proj.addressable_shards[0].data.shape == (1, 1, 16, 64)
    np.testing.assert_array_equal(placed.lm_head.weight, plain.lm_head.weight)
