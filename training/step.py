"""The jitted train and eval steps, and where state and batches are placed on devices.

`place` and `compile_steps` are the two places sharding will plug into (a mesh gives shardings
for the parameters, optimizer state and batch; the jit gets in/out shardings). Today they put
everything on the default device.

Mixed precision: the model holds `Config.param_dtype` weights (float32 master weights, so the
AdamW state is float32 too) and computes in `Config.dtype` (e.g. bfloat16); gradients arrive in
the parameters' dtype. Remat follows `Config.remat` inside the model's scanned blocks.

Gradient accumulation splits the batch into `accum` micro-batches and sums their gradients in a
`lax.scan`; dividing every micro-batch's loss sum by the whole batch's token count makes the
result equal to one step on the whole batch.
"""

from collections.abc import Callable
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import optax

from data.packing import Batch
from training.loss import loss_terms
from zoo import Transformer


def split_model(model: Transformer) -> tuple[Any, Any]:
    """(trainable float arrays, everything else); the optimizer sees only the first."""
    return eqx.partition(model, eqx.is_inexact_array)


def place(tree: Any) -> Any:
    """Put a pytree (parameters, optimizer state or a batch) on the device(s)."""
    return jax.device_put(tree)


def train_step(params, opt_state, batch: Batch, *, static, optimizer, accum: int):
    """One optimizer step on `batch` ([batch, seq] arrays) in `accum` micro-batches."""
    if batch.inputs.shape[0] % accum:
        raise ValueError(
            f"--batch-size {batch.inputs.shape[0]} is not divisible by --grad-accum {accum}"
        )
    micro = jax.tree.map(lambda x: x.reshape(accum, -1, *x.shape[1:]), batch)
    total = jnp.maximum(jnp.sum(batch.loss_mask.astype(jnp.float32)), 1.0)

    def objective(p, mb: Batch):
        terms = loss_terms(eqx.combine(p, static), mb)
        return terms.nll_sum / total, terms.nll_sum

    def add_micro(carry, mb: Batch):
        grads, nll = carry
        (_, nll_mb), g = jax.value_and_grad(objective, has_aux=True)(params, mb)
        return (jax.tree.map(jnp.add, grads, g), nll + nll_mb), None

    zeros = jax.tree.map(jnp.zeros_like, params)
    (grads, nll), _ = jax.lax.scan(add_micro, (zeros, jnp.zeros((), jnp.float32)), micro)
    updates, opt_state = optimizer.update(grads, opt_state, params)
    params = optax.apply_updates(params, updates)
    grad_norm = jnp.sqrt(sum(jnp.sum(jnp.square(g)) for g in jax.tree.leaves(grads)))
    return params, opt_state, {"loss": nll / total, "grad_norm": grad_norm}


def eval_step(params, batch: Batch, *, static):
    """(sum of token losses, token count) on one batch."""
    terms = loss_terms(eqx.combine(params, static), batch)
    return terms.nll_sum, terms.tokens


def compile_steps(
    static, optimizer: optax.GradientTransformation, accum: int = 1
) -> tuple[Callable, Callable]:
    """The jitted (train_step, eval_step). Parameters and optimizer state are donated: the step
    updates them in place instead of holding two copies."""

    def train(params, opt_state, batch):
        return train_step(params, opt_state, batch, static=static, optimizer=optimizer, accum=accum)

    def evaluate(params, batch):
        return eval_step(params, batch, static=static)

    return jax.jit(train, donate_argnums=(0, 1)), jax.jit(evaluate)
