"""MoE training: the router's auxiliary loss enters the gradient, gradient accumulation stays
exact for the cross-entropy, and train.py logs per-expert load and dropped tokens."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import optax

import train
import zoo
from data.packing import Batch
from layers.moe import aux_loss
from tests.training.accumulation import assert_accumulation_exact
from training.loss import AuxWeights
from training.step import split_model, train_step


def _setup(**changes):
    config = zoo.preset("tiny-moe", n_layers=2, d_model=32, n_heads=2, n_kv_heads=1, **changes)
    model = zoo.Transformer(config, key=jax.random.key(1))
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, config.vocab_size, (8, 9))
    segments = np.ones((8, 8), np.int32)
    mask = np.ones((8, 8), np.float32)
    mask[:1, :5] = 0  # micro-batches (rows i::2) count different numbers of targets
    batch = Batch(tokens[:, :-1], tokens[:, 1:], segments, mask)
    return model, jax.tree.map(jnp.asarray, batch)


_run = jax.jit(train_step, static_argnames=("static", "optimizer", "accum", "aux_weights"))


def test_grad_accumulation_exact_without_aux_loss():
    # tests/training/accumulation.py: the bound is derived from float32 summation.
    model, batch = _setup()
    params, static = split_model(model)
    assert_accumulation_exact(params, static, batch, accum=2)


def test_aux_loss_is_the_mean_over_micro_batches_and_moves_the_router():
    model, batch = _setup()
    weights = AuxWeights(load_balancing=0.5, z_loss=0.1)
    params, static = split_model(model)
    sgd = optax.sgd(1.0)
    _, _, metrics = _run(
        params, sgd.init(params), batch, static=static, optimizer=sgd, accum=2,
        aux_weights=weights,
    )  # fmt: skip
    expected = []
    for i in range(2):  # micro-batch i holds rows i::2
        rows = jax.tree.map(lambda x, i=i: x[i::2], batch)
        out = model.forward(rows.inputs, segment_ids=rows.segment_ids)
        expected.append(float(aux_loss(out.aux, load_balancing_weight=0.5, z_loss_weight=0.1)))
    np.testing.assert_allclose(float(metrics.aux_loss), np.mean(expected), rtol=1e-5)
    assert metrics.moe.expert_load.shape == (2, model.config.n_experts)
    np.testing.assert_allclose(metrics.moe.expert_load.sum(-1), 1.0, rtol=1e-5)

    # With the cross-entropy masked out entirely, only the aux loss gives a gradient.
    silent = batch._replace(loss_mask=jnp.zeros_like(batch.loss_mask))
    new, _, _ = _run(
        params, sgd.init(params), silent, static=static, optimizer=sgd, accum=1,
        aux_weights=weights,
    )  # fmt: skip
    changed = jax.tree.map(lambda a, b: bool(jnp.any(a != b)), params, new)
    assert any(jax.tree.leaves(changed))


def test_dense_model_reports_no_experts():
    config = zoo.preset("tiny-llama", n_layers=1, d_model=32, n_heads=2, n_kv_heads=1)
    params, static = split_model(zoo.Transformer(config, key=jax.random.key(0)))
    _, batch = _setup()
    sgd = optax.sgd(0.1)
    _, _, metrics = _run(params, sgd.init(params), batch, static=static, optimizer=sgd, accum=2)
    assert float(metrics.aux_loss) == 0.0 and metrics.moe.dropped_fraction.shape == (0,)


def test_train_py_logs_expert_load_and_drops(tmp_path, tiny_argv):
    argv = tiny_argv(tmp_path / "run", "--model", "tiny-moe")
    train.main([*argv, "--moe-dispatch", "capacity", "--capacity-factor", "0.5"])
    records = [json.loads(x) for x in (tmp_path / "run/metrics.jsonl").read_text().splitlines()]
    logged = [r for r in records if "expert_load" in r]
    assert [r["step"] for r in logged] == [1, 2, 3, 4]
    for r in logged:
        load = np.asarray(r["expert_load"])
        assert load.shape == (2, 4)  # tiny-moe: 2 MoE layers, 4 experts
        np.testing.assert_allclose(load.sum(-1), 1.0, rtol=1e-5)
        # Capacity 0.5 holds half of the assignments a balanced router would send per expert.
        assert all(0.4 <= d < 1 for d in r["dropped_fraction"]) and r["aux_loss"] > 0


def test_dense_run_logs_no_expert_fields(tmp_path, tiny_argv):
    train.main(tiny_argv(tmp_path / "run", "--steps", "2"))
    text = (tmp_path / "run/metrics.jsonl").read_text()
    assert "expert_load" not in text and "aux_loss" not in text


def test_the_step_moves_deepseek_v3_router_biases_by_the_rate_against_the_load():
    """Aux-loss-free balancing: after the optimizer (which never moves the bias: no gradient,
    no decay), each bias moves by exactly +-rate toward the experts the step under-used."""
    config = zoo.preset("tiny-deepseek-v3", d_model=32, n_heads=2, mla_q_rank=16)
    model = zoo.Transformer(config, key=jax.random.key(2))
    _, batch = _setup()
    params, static = split_model(model)
    adam = optax.adamw(1e-2)
    biases = lambda p: [b.mlp.router.bias for b in p.stacks[-1].blocks]  # noqa: E731
    rate = 0.25
    new, _, metrics = _run(
        params, adam.init(params), batch, static=static, optimizer=adam, accum=2,
        aux_weights=AuxWeights(bias_rate=rate),
    )  # fmt: skip
    load = np.asarray(metrics.moe.expert_load)
    want = rate * np.sign(load.mean(-1, keepdims=True) - load)
    pairs = zip(biases(new), biases(params), strict=True)
    moved = np.concatenate([np.asarray(a - b) for a, b in pairs])
    assert np.any(want != 0)
    np.testing.assert_array_equal(moved, want.reshape(moved.shape))
