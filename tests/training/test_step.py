"""The jitted step: gradient accumulation, the loss mask, schedules and the decay mask."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from data.packing import Batch
from tests.training.accumulation import assert_accumulation_exact
from training.loss import loss_terms
from training.optimizer import adamw, decay_mask, learning_rate
from training.step import split_model, train_step
from zoo import Policy, Transformer, preset


def _setup():
    config = preset("tiny-llama", n_layers=1, d_model=32, n_heads=2, n_kv_heads=1, d_ff=64)
    model = Transformer(config, key=jax.random.key(0))
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, config.vocab_size, (8, 13))
    segments = np.cumsum(rng.random((8, 13)) < 0.15, axis=1) + 1
    # Rows have different numbers of counted targets, so a plain mean of micro-batch means
    # would differ from the big batch's mean.
    mask = (segments[:, 1:] == segments[:, :-1]).astype(np.float32)
    mask[:3, :5] = 0
    batch = Batch(tokens[:, :-1], tokens[:, 1:], segments[:, :-1], mask)
    return model, jax.tree.map(jnp.asarray, batch)


def test_grad_accumulation_equals_one_big_batch():
    model, batch = _setup()
    params, static = split_model(model)
    assert_accumulation_exact(params, static, batch, accum=4)


def test_loss_ignores_masked_targets():
    model, batch = _setup()
    terms = loss_terms(model, batch)
    changed = batch._replace(targets=jnp.where(batch.loss_mask > 0, batch.targets, 0))
    assert float(loss_terms(model, changed).nll_sum) == float(terms.nll_sum)
    assert float(terms.tokens) == float(batch.loss_mask.sum())


def test_schedules_warm_up_and_decay_to_the_floor():
    for name in ["cosine", "wsd"]:
        lr = learning_rate(name, peak=1.0, steps=100, warmup=10, min_ratio=0.1)
        assert float(lr(0)) == 0.0 and abs(float(lr(10)) - 1.0) < 1e-6
        assert abs(float(lr(100)) - 0.1) < 1e-6
    wsd = learning_rate("wsd", peak=1.0, steps=100, warmup=10, decay_fraction=0.2)
    assert float(wsd(50)) == float(wsd(79)) == 1.0 and float(wsd(90)) < 1.0
    with pytest.raises(ValueError, match="--schedule"):
        learning_rate("linear", peak=1.0, steps=10, warmup=1)


def test_weight_decay_skips_norms():
    model, _ = _setup()
    params, _ = split_model(model)
    mask = decay_mask(params)
    assert mask.embed.weight and mask.stacks[0].blocks[0].attn_norm.scale is False
    assert jax.tree.structure(mask) == jax.tree.structure(params)


def test_mixed_precision_keeps_float32_master_weights_and_state():
    model, batch = _setup()
    policy = Policy(compute_dtype="bfloat16", remat="full")
    params, static = split_model(Transformer(model.config, policy=policy, key=jax.random.key(0)))
    optimizer = adamw(optax.constant_schedule(1e-2))
    state = optimizer.init(params)
    run = jax.jit(train_step, static_argnames=("static", "optimizer", "accum"))
    new, new_state, metrics = run(params, state, batch, static=static, optimizer=optimizer, accum=2)
    floats = [x for x in jax.tree.leaves((new, new_state)) if jnp.issubdtype(x.dtype, jnp.floating)]
    assert floats and all(x.dtype == jnp.float32 for x in floats)
    assert np.isfinite(float(metrics.loss))
    assert any(
        not np.array_equal(a, b)
        for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(new), strict=True)
    )
