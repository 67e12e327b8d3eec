"""Mixture of experts: routing, both dispatch strategies against a naive per-token loop, drops,
gradients, auxiliary losses and bad inputs."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from layers.moe import Capacity, Dropless, MoE, MoEStats, Router, aux_loss
from zoo import Policy

B, T, D, F, E = 2, 12, 16, 24, 6


def make_moe(*, k=2, dispatch="dropless", capacity_factor=1.25, **kwargs):
    """The layer, called with the dispatch the arguments name (dispatch is a per-call choice)."""
    moe = MoE(D, F, n_experts=E, n_experts_per_token=k, key=jax.random.key(0), **kwargs)
    strategy = {"dropless": Dropless, "capacity": lambda: Capacity(capacity_factor)}[dispatch]()
    return Dispatching(moe, strategy)


class Dispatching(eqx.Module):
    """An MoE layer with its dispatch fixed, called like the layer: x -> (y, stats)."""

    moe: MoE
    dispatch: Dropless | Capacity

    def __getattr__(self, name):  # the layer's router, experts, shared experts
        if name == "moe":
            raise AttributeError(name)
        return getattr(self.moe, name)

    def __call__(self, x):
        return self.moe(x, dispatch=self.dispatch)


def x_input():
    return jax.random.normal(jax.random.key(1), (B, T, D))


def swiglu(x, gate, up, down):
    h = x @ gate
    return (h / (1 + np.exp(-h)) * (x @ up)) @ down


def naive_loop(moe, x, keep=None):
    """Each token, each chosen expert in turn, in float64 numpy; `keep` masks assignments."""
    routing = moe.router(x)
    ids, weights = np.asarray(routing.experts), np.asarray(routing.weights, np.float64)
    gate, up, down = (
        np.asarray(w, np.float64) for w in (moe.experts.gate, moe.experts.up, moe.experts.down)
    )
    xs = np.asarray(x, np.float64)
    y = np.zeros_like(xs)
    for b in range(xs.shape[0]):
        for t in range(xs.shape[1]):
            for j in range(ids.shape[-1]):
                if keep is not None and not keep[b, t, j]:
                    continue
                e = ids[b, t, j]
                y[b, t] += weights[b, t, j] * swiglu(xs[b, t], gate[e], up[e], down[e])
    if moe.shared is not None:
        s = moe.shared
        y += swiglu(xs, *(np.asarray(w.weight, np.float64) for w in (s.gate, s.up, s.down)))
    return y


def priority_keep(ids, capacity):
    """Reference drop rule: per sequence, first choices of every token (in order) claim slots,
    then second choices, ...; an expert that is full drops the assignment."""
    ids = np.asarray(ids)
    keep = np.zeros(ids.shape, bool)
    for b in range(ids.shape[0]):
        used = np.zeros(E, int)
        for j in range(ids.shape[2]):
            for t in range(ids.shape[1]):
                e = ids[b, t, j]
                keep[b, t, j] = used[e] < capacity
                used[e] += 1
    return keep


@pytest.mark.parametrize(
    "options",
    [
        {},
        {"k": 1},
        {"k": 3, "normalize": False},
        {"scoring": "sigmoid"},
        {"n_shared": 2},
    ],
)
def test_dropless_equals_naive_loop(options):
    moe = make_moe(**options)
    x = x_input()
    y, stats = moe(x)
    np.testing.assert_allclose(y, naive_loop(moe, x), rtol=1e-5, atol=1e-5)
    assert float(stats.dropped_fraction) == 0.0


@pytest.mark.parametrize("options", [{}, {"k": 3, "normalize": False, "n_shared": 1}])
def test_large_capacity_equals_dropless(options):
    x = x_input()
    y_dropless, s_dropless = make_moe(**options)(x)
    y_capacity, s_capacity = make_moe(dispatch="capacity", capacity_factor=100.0, **options)(x)
    np.testing.assert_allclose(y_capacity, y_dropless, rtol=1e-5, atol=1e-6)
    for a, b in zip(jax.tree.leaves(s_capacity), jax.tree.leaves(s_dropless), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-6)


@pytest.mark.parametrize(("k", "factor"), [(1, 0.5), (2, 0.6), (3, 1.0)])
def test_small_capacity_drops_exactly_the_reported_tokens(k, factor):
    moe = make_moe(k=k, dispatch="capacity", capacity_factor=factor)
    x = x_input()
    routing = moe.router(x)
    capacity = int(np.ceil(factor * T * k / E))
    expected_keep = priority_keep(routing.experts, capacity)
    assert not expected_keep.all()  # the test must actually drop something
    out = moe.dispatch(moe.experts, x, routing.experts, routing.weights)
    np.testing.assert_array_equal(out.kept, expected_keep)
    np.testing.assert_allclose(out.y, naive_loop(moe, x, expected_keep), rtol=1e-5, atol=1e-5)
    _, stats = moe(x)
    np.testing.assert_allclose(stats.dropped_fraction, 1 - expected_keep.mean(), rtol=1e-6)


@pytest.mark.parametrize("dispatch", ["dropless", "capacity"])
def test_gradients_reach_router_and_experts(dispatch):
    moe = make_moe(dispatch=dispatch, capacity_factor=3.0, n_shared=1)
    x = x_input()

    def loss(model):
        y, stats = model(x)
        return jnp.mean(y**2) + aux_loss(stats, load_balancing_weight=0.1, z_loss_weight=0.01)

    grad = eqx.filter_jit(eqx.filter_grad(loss))  # one program, not op by op
    grads = grad(moe)
    for name, g in [
        ("router", grads.router.weight),
        ("gate", grads.experts.gate),
        ("up", grads.experts.up),
        ("down", grads.experts.down),
        ("shared", grads.shared.up.weight),
    ]:
        assert np.all(np.isfinite(g)), name
        assert np.abs(np.asarray(g)).max() > 0, name
    # Both dispatchers compute the same function here, so the same gradients.
    if dispatch == "capacity":
        reference = grad(eqx.tree_at(lambda m: m.dispatch, moe, Dropless()))
        for a, b in zip(jax.tree.leaves(grads), jax.tree.leaves(reference), strict=True):
            np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)


def test_gradients_match_finite_differences_of_the_router():
    moe = make_moe()
    x = x_input()
    direction = jax.random.normal(jax.random.key(5), moe.router.weight.shape)

    @jax.jit  # one program, not op by op
    def loss_along(eps):
        model = eqx.tree_at(lambda m: m.router.weight, moe, moe.router.weight + eps * direction)
        return jnp.sum(model(x)[0] * x)

    analytic = jax.jit(jax.grad(loss_along))(0.0)
    eps = 1e-3
    numeric = (loss_along(eps) - loss_along(-eps)) / (2 * eps)
    np.testing.assert_allclose(analytic, numeric, rtol=2e-2)


def router_with(weight, **kwargs):
    router = Router(D, E, n_experts_per_token=2, key=jax.random.key(0), **kwargs)
    return eqx.tree_at(lambda r: r.weight, router, weight)


def stats_of(router, x):
    return eqx.tree_at(lambda m: m.router, make_moe(), router)(x)[1]


def test_load_balancing_loss_is_one_for_a_uniform_router_and_larger_otherwise():
    x = jnp.abs(x_input()) + 0.1
    uniform = stats_of(router_with(jnp.zeros((D, E))), x)
    np.testing.assert_allclose(uniform.load_balancing_loss, 1.0, rtol=1e-6)
    # Positive inputs, a router that puts all probability on expert 0 and ranks expert 1 second:
    # P = (1, 0, ...), f = (1/2, 1/2, 0, ...), so the loss is E / 2.
    collapsed = jnp.zeros((D, E)).at[:, 0].set(100.0).at[:, 1].set(50.0)
    np.testing.assert_allclose(
        stats_of(router_with(collapsed), x).load_balancing_loss, E / 2, rtol=1e-3
    )
    # Confident random routers: P ~ f, so the loss ~ E x sum f^2 >= 1 (Cauchy-Schwarz).
    for seed in range(4):
        weight = 30 * jax.random.normal(jax.random.key(seed), (D, E))
        assert float(stats_of(router_with(weight), x).load_balancing_loss) >= 1.0 - 1e-3


def test_z_loss_and_expert_load():
    x = x_input()
    stats = stats_of(router_with(jnp.zeros((D, E))), x)
    # Zero logits: logsumexp = log E for every token.
    np.testing.assert_allclose(stats.z_loss, np.log(E) ** 2, rtol=1e-6)
    # top-k of equal scores picks the lowest ids: experts 0 and 1 take half the load each.
    np.testing.assert_allclose(stats.expert_load, [0.5, 0.5, 0, 0, 0, 0], atol=1e-7)


def test_router_top_k_and_renormalisation():
    x = x_input()
    router = Router(D, E, n_experts_per_token=3, key=jax.random.key(2))
    routing = router(x)
    probs = jax.nn.softmax(jnp.einsum("bsd,de->bse", x, router.weight), axis=-1)
    top = np.sort(np.asarray(probs), axis=-1)[..., ::-1][..., :3]
    np.testing.assert_allclose(routing.weights, top / top.sum(-1, keepdims=True), rtol=1e-5)
    chosen = np.take_along_axis(np.asarray(probs), np.asarray(routing.experts), -1)
    np.testing.assert_allclose(chosen, top, rtol=1e-6)
    raw = Router(D, E, n_experts_per_token=3, normalize=False, key=jax.random.key(2))(x)
    np.testing.assert_allclose(raw.weights, top, rtol=1e-5)


def test_aux_loss_of_a_dense_model_is_zero():
    assert float(aux_loss(MoEStats.empty(4), load_balancing_weight=1.0, z_loss_weight=1.0)) == 0.0


def test_expert_weights_are_stacked_with_experts_first():
    moe = make_moe(n_shared=1)
    assert moe.experts.gate.shape == (E, D, F) and moe.experts.down.shape == (E, F, D)
    assert moe.router.weight.shape == (D, E)
    assert moe.experts.logical_axes()["down"] == ("experts", "mlp", "embed")
    assert moe.router.logical_axes()["weight"] == ("embed", "experts")


def test_bad_inputs_say_what_is_wrong():
    with pytest.raises(ValueError, match="n_experts_per_token=7"):
        make_moe(k=7)
    with pytest.raises(ValueError, match="capacity_factor must be > 0"):
        make_moe(dispatch="capacity", capacity_factor=0.0)
    # A dispatch is an object; the policy names the choices for a string.
    with pytest.raises(Exception, match="dispatch"):
        MoE(D, F, n_experts=E, n_experts_per_token=2, key=jax.random.key(0))(
            x_input(), dispatch="sorted"
        )
    with pytest.raises(ValueError, match=r"Policy\.moe_dispatch='sorted' is unknown"):
        Policy(moe_dispatch="sorted")
    with pytest.raises(Exception, match="scoring"):
        make_moe(scoring="relu")
    with pytest.raises(ValueError, match="n_shared=-1"):
        make_moe(n_shared=-1)
    with pytest.raises(ValueError, match="capacity_factor"):
        Capacity(-1.0)


def test_capacity_dispatch_runs_with_experts_sharded_over_devices():
    # Every stacked expert weight split over 8 devices on its leading `experts` axis (the ep
    # layout); tokens split over the batch. Same numbers as on one device.
    layer = MoE(D, F, n_experts=8, n_experts_per_token=2, key=jax.random.key(0))
    moe = Dispatching(layer, Capacity(1.25))
    mesh = Mesh(np.array(jax.devices()[:8]).reshape(2, 4), ("data", "expert"))
    experts = jax.tree.map(
        lambda w: jax.device_put(w, NamedSharding(mesh, PartitionSpec("expert"))), moe.experts
    )
    sharded = eqx.tree_at(lambda m: m.experts, moe, experts)
    x = jax.device_put(x_input(), NamedSharding(mesh, PartitionSpec("data")))
    y, _ = eqx.filter_jit(lambda m, x: m(x))(sharded, x)
    np.testing.assert_allclose(y, moe(x_input())[0], rtol=1e-5, atol=1e-5)
