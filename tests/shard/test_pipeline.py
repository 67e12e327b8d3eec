"""Pipeline parallelism (shard/pipeline.py, zoo/pipeline.py, zoo/pipeline_loss.py) on 8 fake
CPU devices: the 1F1B and interleaved schedules' loss and gradient equal the one-device model's
on an MoE and a Gemma-pattern model (a dense one: tests/training/test_pipeline.py, through
train.py); the stages hand activations on with collective-permutes; 1F1B holds less memory than
GPipe, as zoo.math predicts; every pipeline that cannot run is refused with its numbers."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import shard
import zoo
from data.packing import to_batch
from training.loss import loss_terms

# Naive attention: the cheapest kernel to compile (the kernels are tested elsewhere).
CONFIG = zoo.preset("tiny-llama", n_layers=4, vocab_size=256)
POLICY = zoo.Policy(attention="naive", microbatches=4)
TOKENS = jnp.asarray(np.random.default_rng(0).integers(0, CONFIG.vocab_size, (8, 16)), jnp.int32)
# The models of the schedule test: 8 layers (interleaved: 4 stages x 2 chunks of one layer); the
# Gemma-pattern model's stack repeats a (sliding, global) period, so it needs 16.
MODELS = {
    "dense": zoo.preset("tiny-llama", n_layers=8, vocab_size=256),
    "moe": zoo.preset("tiny-moe", n_layers=8, vocab_size=256),
    "gemma": zoo.preset(
        "gemma3-1b", n_layers=16, vocab_size=256, d_model=32, n_heads=2, n_kv_heads=1,
        head_dim=16, d_ff=64, max_seq_len=64, sliding_window=4,
        layer_types=("sliding", "full") * 8, local_rope_theta=100.0,
    ),
}  # fmt: skip
MICRO = 4


def _placement(**sizes) -> shard.Placement:
    return shard.Placement(
        shard.mesh(**sizes), shard.ShardingRules.preset(shard.default_rules(sizes))
    )


def _loss(model, tokens):
    logits = model(tokens)
    return jnp.mean(jax.nn.logsumexp(logits, axis=-1) - logits[..., 0])


def test_gpipe_forward_equals_one_device_and_permutes():
    """`model(tokens)` under a pipeline mesh (zoo/pipeline.run_stack: the GPipe schedule over
    each stack, the embedding and head outside)."""
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


def _batch(config, rows: int = 8):
    """Two packed documents per row (positions restart, attention stays inside each)."""
    tokens = np.random.default_rng(1).integers(0, config.vocab_size, (rows, 17)).astype(np.int32)
    segments = np.ones_like(tokens)
    segments[:, 9:] = 2
    return to_batch(tokens, segments)


def _objective(params, static, batch, **scales):
    terms = loss_terms(eqx.combine(params, static), batch, **scales)
    return terms.objective, terms


def _under(params, static, policy):
    """(trainable, frozen) halves of the model under `policy` (the same arrays)."""
    return eqx.partition(eqx.combine(params, static).with_policy(policy), eqx.is_inexact_array)


@pytest.fixture(scope="module")
def references():
    """Per model: (params, static, batch, objective, gradient) on one device, by gradient
    accumulation over the pipeline's micro-batches (rows i::4), so each micro-batch's MoE
    routing is balanced on its own, as in the pipeline. Traced under rules that replicate
    everything, so that its norms sum as the pipeline's do (XLA's reduce under a mesh's rules:
    layers.norm.row_mean)."""
    found = {}

    def reference(name):
        if name in found:
            return found[name]
        model = zoo.Transformer(MODELS[name], policy=zoo.Policy(attention="naive"),
                                key=jax.random.key(0))  # fmt: skip
        params, static = eqx.partition(model, eqx.is_inexact_array)
        batch = _batch(model.config)

        @jax.jit
        def accumulated(params, batch):
            total = jnp.sum(batch.loss_mask)
            micro = jax.tree.map(lambda x: x.reshape(-1, MICRO, *x.shape[1:]).swapaxes(0, 1), batch)

            def add(carry, mb):
                g = jax.grad(_objective, has_aux=True)
                grads, terms = g(params, static, mb, nll_scale=1 / total, aux_scale=1 / MICRO)
                return jax.tree.map(jnp.add, carry, grads), terms

            zeros = jax.tree.map(jnp.zeros_like, params)
            with shard.rules.use_rules(shard.ShardingRules(), shard.mesh(data=8)):
                grads, terms = jax.lax.scan(add, zeros, micro)
            return jnp.sum(terms.nll_sum) / total + jnp.mean(terms.aux_loss), grads

        found[name] = (params, static, batch, *accumulated(params, batch))
        return found[name]

    return reference


@pytest.mark.parametrize("schedule", ["1f1b", "interleaved"])
@pytest.mark.parametrize("name", ["moe", "gemma"])
def test_schedules_equal_the_unsharded_model(references, name, schedule):
    params, static, batch, expected, expected_grads = references(name)
    policy = zoo.Policy(attention="naive", microbatches=MICRO, pipeline_schedule=schedule)
    params, static = _under(params, static, policy)
    placement = _placement(pipeline=4, data=2)

    def step(params, batch):
        with placement.context():
            total = jnp.sum(batch.loss_mask)
            g = jax.value_and_grad(_objective, has_aux=True)
            (value, _), grads = g(params, static, batch, nll_scale=1 / total, aux_scale=1.0)
            return value, grads

    compiled = jax.jit(step).lower(placement.place(params), placement.batch(batch)).compile()
    assert "collective-permute" in compiled.as_text()
    value, grads = compiled(placement.place(params), placement.batch(batch))
    # float32 sums in another order (micro-batches in flight, data-parallel halves, 1F1B's
    # gradient summed per stage): a few ulps of the loss, ~1e-6 of the ~1e-1 gradients.
    np.testing.assert_allclose(value, expected, rtol=1e-6)
    for got, want in zip(jax.tree.leaves(grads), jax.tree.leaves(expected_grads), strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-6)


def test_1f1b_holds_less_memory_than_gpipe_at_16_microbatches():
    """At M = 16 micro-batches on 4 stages GPipe keeps every micro-batch's activations over 19
    ticks, 1F1B at most 7 stage inputs and one micro-batch's activations: XLA's compiled peak
    per device is lower, as zoo.math.pipeline_activation_bytes predicts."""
    config, m, seq, rows = MODELS["dense"], 16, 16, 32  # 2 rows per micro-batch (data=2)
    model = zoo.Transformer(config, policy=zoo.Policy(attention="naive"), key=jax.random.key(0))
    params, static = eqx.partition(model, eqx.is_inexact_array)
    placement = _placement(pipeline=4, data=2)
    batch = placement.batch(_batch(config, rows=rows))
    measured, predicted = {}, {}
    for schedule in ("gpipe", "1f1b"):
        policy = zoo.Policy(attention="naive", microbatches=m, pipeline_schedule=schedule)
        trainable, frozen = _under(params, static, policy)

        def step(params, batch, frozen=frozen):
            with placement.context():
                return jax.grad(_objective, has_aux=True)(params, frozen, batch)[0]

        lowered = jax.jit(step).lower(placement.place(trainable), batch)
        measured[schedule] = lowered.compile().memory_analysis().temp_size_in_bytes
        predicted[schedule] = zoo.math.pipeline_activation_bytes(
            config, seq, policy, tokens=rows * seq // 2, stages=4, microbatches=m,
            schedule=schedule,
        )  # fmt: skip
    assert predicted["1f1b"] < predicted["gpipe"]
    assert measured["1f1b"] < measured["gpipe"], measured


@pytest.mark.parametrize(
    ("config", "policy", "sizes", "call", "message"),
    [
        (CONFIG.replace(n_layers=3), POLICY, {"pipeline": 2, "data": 4}, "forward",
         r"pipeline size 2 does not divide the 3 layers"),
        (CONFIG, POLICY.replace(microbatches=2), {"pipeline": 4, "data": 2}, "forward",
         r"2 micro-batches are fewer than the 4 pipeline stages"),
        (CONFIG, POLICY.replace(microbatches=3), {"pipeline": 2, "data": 4}, "forward",
         r"a batch of 8 sequences does not split into 3 micro-batches"),
        (CONFIG, POLICY, {"pipeline": 4, "data": 2}, "decode",
         r"a KV cache with a pipeline of 4 stages"),
        # A schedule that does not fit the layer count.
        (CONFIG, POLICY.replace(pipeline_schedule="interleaved"), {"pipeline": 4, "data": 2},
         "loss", r"4 stages x 2 virtual stages = 8 chunks does not divide the 4 layers"),
        (MODELS["gemma"].replace(n_layers=8, layer_types=("sliding", "full") * 4),
         POLICY.replace(pipeline_schedule="interleaved"), {"pipeline": 4, "data": 2}, "loss",
         r"8 chunks does not divide the 4 repeats of a layer stack's 2-layer period \(8 layers"),
        (CONFIG, POLICY.replace(pipeline_schedule="interleaved", virtual_stages=1),
         {"pipeline": 4, "data": 2}, "loss",
         r"the interleaved schedule needs at least 2 virtual stages per device, got 1"),
        (zoo.preset("tiny-deepseek-moe", n_layers=8, first_dense_layers=4),
         POLICY.replace(pipeline_schedule="1f1b"), {"pipeline": 4, "data": 2}, "loss",
         r"the 1F1B schedule runs one layer stack and this model has 2 \(4, 4 layers"),
    ],
)  # fmt: skip
def test_pipelines_that_cannot_run_are_refused(config, policy, sizes, call, message):
    model = eqx.filter_eval_shape(zoo.Transformer, config, policy=policy, key=jax.random.key(0))
    cache = model.init_cache(8, 16) if call == "decode" else None
    batch = jax.tree.map(jnp.asarray, to_batch(np.asarray(TOKENS), np.ones_like(TOKENS)))

    def run(m):
        if call == "loss":
            return loss_terms(m, batch).objective
        return m.forward(TOKENS, cache=cache).logits

    with _placement(**sizes).context(), pytest.raises(ValueError, match=message):
        # Tracing is enough: every check runs before anything compiles.
        eqx.filter_eval_shape(run, model)
