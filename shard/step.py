"""What a sharded training loop calls: batches and optimizer state placed in their shardings,
and one jitted step with explicit in/out shardings (train.py's --mesh path)."""

from collections.abc import Callable

import equinox as eqx
import jax
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding
from jaxtyping import Array, PyTree

from shard.params import param_shardings, replicated
from shard.rules import ShardingRules, check_divisible, named_sharding, use_rules


def shard_batch(batch: PyTree, rules: ShardingRules, mesh: Mesh, axes: str = "batch seq") -> PyTree:
    """Place every array of `batch` (host arrays, the same global batch on every process) in
    the sharding of `axes`. Works across processes: each one fills only its own devices."""
    sharding = named_sharding(axes, rules, mesh)
    names = tuple(axes.split())

    def place(x):
        x = np.asarray(x)
        check_divisible(f"batch array {x.shape}", x.shape, names, sharding.spec, dict(mesh.shape))
        return jax.make_array_from_callback(x.shape, sharding, lambda index: x[index])

    return jax.tree.map(place, batch)


def opt_state_shardings(
    optimizer: optax.GradientTransformation, model: PyTree, rules: ShardingRules, mesh: Mesh
) -> PyTree:
    """Shardings of `optimizer.init(params)`: moments shaped like a parameter take that
    parameter's sharding; everything else (step counts) is replicated."""
    params = eqx.filter(model, eqx.is_array)
    abstract = jax.eval_shape(optimizer.init, params)
    return optax.tree_map_params(
        optimizer,
        lambda _, sharding: sharding,
        abstract,
        param_shardings(model, rules, mesh),
        transform_non_params=lambda _: replicated(mesh),
        is_leaf=lambda x: isinstance(x, NamedSharding),
    )


def init_opt_state(
    optimizer: optax.GradientTransformation, model: PyTree, rules: ShardingRules, mesh: Mesh
) -> PyTree:
    """`optimizer.init` run on device with the state created in its shardings."""
    shardings = opt_state_shardings(optimizer, model, rules, mesh)
    return jax.jit(optimizer.init, out_shardings=shardings)(eqx.filter(model, eqx.is_array))


class ShardedStep:
    """`step(model, opt_state, batch) -> (model, opt_state, loss)`: value_and_grad of
    `loss_fn(model, batch)` under the rules (so `constrain` is active), then the optimizer
    update, jitted with the parameters', optimizer state's and batch's shardings in and out.
    The model and optimizer state are donated."""

    def __init__(
        self,
        loss_fn: Callable[[PyTree, PyTree], Array],
        optimizer: optax.GradientTransformation,
        model: PyTree,
        rules: ShardingRules,
        mesh: Mesh,
        *,
        batch_axes: str = "batch seq",
    ):
        self.static = eqx.partition(model, eqx.is_array)[1]
        params = param_shardings(model, rules, mesh)
        state = opt_state_shardings(optimizer, model, rules, mesh)
        batch = named_sharding(batch_axes, rules, mesh)

        def step(params, opt_state, batch):
            def loss_of(p):
                return loss_fn(eqx.combine(p, self.static), batch)

            with use_rules(rules, mesh):
                loss, grads = jax.value_and_grad(loss_of)(params)
            updates, opt_state = optimizer.update(grads, opt_state, params)
            return optax.apply_updates(params, updates), opt_state, loss

        self.jitted = jax.jit(
            step,
            in_shardings=(params, state, batch),
            out_shardings=(params, state, replicated(mesh)),
            donate_argnums=(0, 1),
        )

    def __call__(self, model: PyTree, opt_state: PyTree, batch: PyTree):
        params, opt_state, loss = self.jitted(eqx.filter(model, eqx.is_array), opt_state, batch)
        return eqx.combine(params, self.static), opt_state, loss

    def compile(
        self,
        model: PyTree,
        opt_state: PyTree,
        batch: PyTree,
        *,
        compiler_options: dict[str, str | bool | int | float] | None = None,
    ) -> jax.stages.Compiled:
        """The step compiled ahead of time for these shapes (with XLA `compiler_options`, e.g.
        {"xla_backend_optimization_level": 0}): `.as_text()` is the optimised per-device HLO
        (which collectives it runs), `.memory_analysis()` its buffers; calling it takes
        `eqx.filter(model, eqx.is_array)` in place of the model."""
        lowered = self.jitted.lower(eqx.filter(model, eqx.is_array), opt_state, batch)
        return lowered.compile(compiler_options)
