"""DeepSeek-V3 routing: sigmoid scores, the balancing bias for selection only, group-limited
top-k, renormalised and scaled gates, against a NumPy transcription of transformers'
DeepseekV3TopkRouter; the bias gets no gradient and the optimizer leaves it where it is; the
auxiliary-loss-free update moves it."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import zoo
from layers.moe import Router
from tests.zoo.random_model import random_model
from training.optimizer import adamw

D, EXPERTS, K, GROUPS, TOPK_GROUPS = 16, 8, 3, 4, 2


def router(normalize=True) -> Router:
    r = Router(
        D,
        EXPERTS,
        n_experts_per_token=K,
        scoring="sigmoid",
        normalize=normalize,
        scale=2.5,
        bias=True,
        groups=GROUPS,
        topk_groups=TOPK_GROUPS,
        key=jax.random.key(0),
    )
    # A bias as large as the scores' spread, so that it changes which experts are chosen.
    return eqx.tree_at(lambda m: m.bias, r, 0.3 * jax.random.normal(jax.random.key(1), (EXPERTS,)))


def hf_routing(x, weight, bias, normalize):
    """transformers' DeepseekV3TopkRouter.forward, in NumPy (float64)."""
    scores = 1 / (1 + np.exp(-(x @ weight)))
    choice = scores + bias
    grouped = choice.reshape(len(x), GROUPS, -1)
    group_scores = np.sort(grouped, axis=-1)[..., -2:].sum(-1)
    best_groups = np.argsort(-group_scores, axis=-1)[:, :TOPK_GROUPS]
    keep = np.zeros_like(group_scores, bool)
    np.put_along_axis(keep, best_groups, True, axis=-1)
    choice = np.where(np.repeat(keep, EXPERTS // GROUPS, axis=-1), choice, -np.inf)
    experts = np.argsort(-choice, axis=-1)[:, :K]
    weights = np.take_along_axis(scores, experts, axis=-1)
    if normalize:
        weights = weights / (weights.sum(-1, keepdims=True) + 1e-20)
    return experts, weights * 2.5


@pytest.mark.parametrize("normalize", [True, False])
def test_routing_matches_transformers(normalize):
    r = router(normalize)
    x = np.asarray(jax.random.normal(jax.random.key(2), (64, D)))
    routing = r(jnp.asarray(x))
    experts, weights = hf_routing(
        x, np.asarray(r.weight, np.float64), np.asarray(r.bias), normalize
    )
    # Both list the chosen experts best first (by biased score); float32 vs float64 scores.
    np.testing.assert_array_equal(np.asarray(routing.experts), experts)
    np.testing.assert_allclose(np.asarray(routing.weights), weights, rtol=1e-5)
    # The bias decided something here (else the test would not show it is used for selection).
    no_bias, _ = hf_routing(x, np.asarray(r.weight, np.float64), 0.0, normalize)
    assert (np.sort(no_bias, -1) != np.sort(experts, -1)).any()


def test_the_bias_gets_no_gradient_and_the_optimizer_leaves_it():
    r = router()
    x = jax.random.normal(jax.random.key(3), (32, D))
    loss = lambda m: jnp.sum(m(x).weights ** 2)  # noqa: E731
    grads = eqx.filter_jit(eqx.filter_grad(loss))(r)  # one program, not op by op
    assert not jnp.any(grads.bias) and jnp.any(grads.weight)
    params = eqx.filter(r, eqx.is_inexact_array)
    optimizer = adamw(optax.constant_schedule(1e-2), weight_decay=0.1)
    state = optimizer.init(params)
    for _ in range(2):
        updates, state = optimizer.update(grads, state, params)
        params = optax.apply_updates(params, updates)
    np.testing.assert_array_equal(params.bias, r.bias)
    assert jnp.any(params.weight != r.weight)


def test_bad_groups_are_refused():
    with pytest.raises(ValueError, match="groups=3 must divide n_experts=8"):
        Router(D, EXPERTS, n_experts_per_token=2, groups=3, key=jax.random.key(0))
    with pytest.raises(ValueError, match="exceeds the experts of the topk_groups=1"):
        Router(D, EXPERTS, n_experts_per_token=3, groups=4, topk_groups=1, key=jax.random.key(0))
    with pytest.raises(ValueError, match="bias needs scoring='sigmoid'"):
        Router(D, EXPERTS, n_experts_per_token=2, bias=True, key=jax.random.key(0))


def test_aux_loss_free_update_moves_each_layers_bias_against_its_load():
    """Stacked and unrolled storage get the same update, layer by layer (loads shaped as the
    forward's MoEStats.expert_load: [MoE layers, experts], each row summing to 1)."""
    model = random_model(zoo.preset("tiny-deepseek-v3", n_layers=4), 0)
    load = jax.nn.softmax(jax.random.normal(jax.random.key(4), (3, EXPERTS)), axis=-1)
    rate = 0.01
    expected = rate * np.sign(np.mean(load, -1, keepdims=True) - load)
    for storage in (model, model.with_policy(storage="unrolled")):
        updated = zoo.update_router_bias(storage, load, rate)
        for i, layer in enumerate(updated.config.moe_layers):
            before = storage.layer(layer).mlp.router.bias
            moved = updated.layer(layer).mlp.router.bias - before
            np.testing.assert_allclose(moved, expected[i], atol=1e-7)
    with pytest.raises(ValueError, match="3 MoE layers of 8 experts"):
        zoo.update_router_bias(model, load[:2], rate)
