"""Gradient accumulation checked on the gradients themselves, against a bound derived from float32
summation instead of a tuned tolerance.

What `train_step` with `accum` micro-batches must compute is the gradient of the whole batch's
mean cross-entropy: sum_i grad(nll_sum_i / N), where micro-batch i holds rows i::accum and N is
the whole batch's count of target tokens. Each term is computed here on its own, by the same
loss on the same micro-batch shape, as the step's scan body computes it; the step adds the accum
terms in its scan order. Any float32 summation order of k terms is within gamma_{k-1} sum |x_i|
of the exact sum (Higham, "Accuracy and Stability of Numerical Algorithms", 2002, eq. 4.4;
gamma_m = m u / (1 - m u), u = 2^-24), so two orders differ by at most 2 gamma_{k-1} sum_i |x_i|
per element. That the micro-batch gradients add up to the whole batch's is linearity of
differentiation (their float32 summation order inside XLA is not this code's); what the step can
get wrong, the normalisation and the sum, is what this checks, and a wrong normalisation falls
far outside the bound.
"""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax

from training.loss import AuxWeights, loss_terms
from training.step import train_step

U = float(np.finfo(np.float32).eps) / 2  # unit roundoff of float32
# The cross-entropy alone (an MoE model's router losses are per micro-batch statistics).
NO_AUX = AuxWeights(load_balancing=0.0, z_loss=0.0)


def gamma(m: int) -> float:
    return m * U / (1 - m * U)


def record_gradient() -> optax.GradientTransformation:
    """An 'optimizer' that leaves the parameters alone and keeps the gradient it was given as
    its state: the step hands over the exact accumulated gradient."""
    return optax.GradientTransformation(
        init=lambda params: jax.tree.map(jnp.zeros_like, params),
        update=lambda grads, state, params=None: (jax.tree.map(jnp.zeros_like, grads), grads),
    )


def step_gradient(params, static, batch, accum: int, aux_weights=NO_AUX):
    optimizer = record_gradient()
    run = jax.jit(train_step, static_argnames=("static", "optimizer", "accum", "aux_weights"))
    _, gradient, metrics = run(
        params, optimizer.init(params), batch, static=static, optimizer=optimizer, accum=accum,
        aux_weights=aux_weights,
    )  # fmt: skip
    return gradient, metrics


def micro_gradients(params, static, batch, accum: int) -> list:
    """grad(nll_sum / N) of each micro-batch (rows i::accum), each on its own, N the whole
    batch's target count (the objective each micro-batch of the step differentiates)."""
    total = jnp.sum(batch.loss_mask)
    grad = jax.jit(jax.grad(lambda p, b: loss_terms(eqx.combine(p, static), b).nll_sum / total))
    return [grad(params, jax.tree.map(lambda x, i=i: x[i::accum], batch)) for i in range(accum)]


def assert_accumulation_exact(params, static, batch, accum: int) -> None:
    """The step's accumulated gradient equals sum_i grad(nll_sum_i) / N within the float32
    summation bound, element by element; a per-micro-batch normalisation (each divided by its own
    token count, the classic accumulation bug) would not."""
    accumulated, metrics = step_gradient(params, static, batch, accum)
    total = float(np.asarray(batch.loss_mask).sum())
    terms = [jax.tree.map(np.asarray, g) for g in micro_gradients(params, static, batch, accum)]
    exact = jax.tree.map(lambda *g: np.sum(g, axis=0, dtype=np.float64), *terms)
    scale = jax.tree.map(lambda *g: np.sum(np.abs(g), axis=0, dtype=np.float64), *terms)
    bound = jax.tree.map(lambda s: 2 * gamma(accum - 1) * s, scale)
    for got, want, tol in zip(jax.tree.leaves(accumulated), jax.tree.leaves(exact),
                              jax.tree.leaves(bound), strict=True):  # fmt: skip
        excess = np.abs(np.asarray(got, np.float64) - want) - tol
        assert np.all(excess <= 0), f"beyond the float32 summation bound by {excess.max()}"
    # The reported loss: a sum of positive terms, so the same bound holds relative to it.
    _, whole = step_gradient(params, static, batch, 1)
    n = int(np.asarray(batch.loss_mask).size)
    np.testing.assert_allclose(metrics.loss, whole.loss, rtol=2 * gamma(n - 1) + 2 * U)
    # The check has teeth: normalising each micro-batch by its own token count is outside it.
    micro = [jax.tree.map(lambda x, i=i: x[i::accum], batch) for i in range(accum)]
    counts = [float(np.asarray(m.loss_mask).sum()) for m in micro]
    assert len(set(counts)) > 1, "the batch must count tokens unevenly across micro-batches"
    wrong = jax.tree.map(
        lambda *g: (
            sum(np.asarray(x, np.float64) * total / c for x, c in zip(g, counts, strict=True))
            / accum
        ),
        *terms,
    )
    assert any(
        np.any(np.abs(w - e) > t)
        for w, e, t in zip(
            jax.tree.leaves(wrong), jax.tree.leaves(exact), jax.tree.leaves(bound), strict=True
        )
    )
