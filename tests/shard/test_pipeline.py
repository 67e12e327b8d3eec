"""Pipeline parallelism (shard/pipeline.py, zoo/pipeline.py) on 8 fake CPU devices: the GPipe
forward and backward equal the one-device model's, the stages hand activations on with
collective-permutes, and every pipeline that cannot run is refused with its numbers."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import shard
import zoo

# Naive attention: the cheapest kernel to compile (the kernels are tested elsewhere).
CONFIG = zoo.preset("tiny-llama", n_layers=4, vocab_size=256)
POLICY = zoo.Policy(attention="naive", microbatches=4)
TOKENS = jnp.asarray(np.random.default_rng(0).integers(0, CONFIG.vocab_size, (8, 16)), jnp.int32)


def _placement(**sizes) -> shard.Placement:
    return shard.Placement(
        shard.mesh(**sizes), shard.ShardingRules.preset(shard.default_rules(sizes))
    )


def _loss(model, tokens):
    logits = model(tokens)
    return jnp.mean(jax.nn.logsumexp(logits, axis=-1) - logits[..., 0])


def test_gpipe_equals_one_device_and_permutes():
    model = zoo.Transformer(CONFIG, policy=POLICY, key=jax.random.key(0))
    params, static = eqx.partition(model, eqx.is_array)
    grad = jax.value_and_grad(lambda p, t: _loss(eqx.combine(p, static), t))
    expected_loss, expected = jax.jit(grad)(params, TOKENS)

    placement = _placement(pipeline=4, data=2)
    placed = placement.place(params)
    stacked = jax.tree.leaves(placed.stacks)
    # The layer axis is split over the stages: each device holds one of the 4 layers.
    assert all(w.addressable_shards[0].data.shape[0] == 1 for w in stacked)

    def sharded(p, t):
        with placement.context():
            return grad(p, t)

    compiled = jax.jit(sharded).lower(placed, TOKENS).compile()
    assert "collective-permute" in compiled.as_text()
    loss, grads = compiled(placed, TOKENS)
    # The same float32 sums in another order (4 micro-batches, data-parallel halves): a few
    # ulps of the ~1e-1 gradients.
    np.testing.assert_allclose(loss, expected_loss, rtol=1e-6)
    for got, want in zip(jax.tree.leaves(grads), jax.tree.leaves(expected), strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize(
    ("config", "policy", "sizes", "call", "message"),
    [
        (CONFIG.replace(n_layers=3), POLICY, {"pipeline": 2, "data": 4}, "train",
         r"pipeline size 2 does not divide the 3 layers"),
        (CONFIG, POLICY.replace(microbatches=2), {"pipeline": 4, "data": 2}, "train",
         r"2 micro-batches are fewer than the 4 pipeline stages"),
        (CONFIG, POLICY.replace(microbatches=3), {"pipeline": 2, "data": 4}, "train",
         r"a batch of 8 sequences does not split into 3 micro-batches"),
        (zoo.preset("tiny-moe", n_layers=2), POLICY, {"pipeline": 2, "expert": 4}, "train",
         r"pipeline of 2 stages over MoE layers"),
        (CONFIG, POLICY, {"pipeline": 4, "data": 2}, "decode",
         r"a KV cache with a pipeline of 4 stages"),
    ],
)  # fmt: skip
def test_pipelines_that_cannot_run_are_refused(config, policy, sizes, call, message):
    model = eqx.filter_eval_shape(zoo.Transformer, config, policy=policy, key=jax.random.key(0))
    cache = model.init_cache(8, 16) if call == "decode" else None
    with _placement(**sizes).context(), pytest.raises(ValueError, match=message):
        # Tracing is enough: every check runs before anything compiles.
        eqx.filter_eval_shape(lambda m: m.forward(TOKENS, cache=cache), model)
