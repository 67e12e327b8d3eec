"""Parameter shardings: specs from logical axes, placing a model, creating one already sharded
so that no device ever holds a whole parameter it should only hold a shard of, and the optimizer
state in the same shardings."""

from collections.abc import Callable

import equinox as eqx
import jax
import optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec
from jaxtyping import PRNGKeyArray, PyTree

from shard.axes import LogicalAxes, is_array_like, logical_axes
from shard.rules import ShardingRules, check_divisible, check_mesh


def _is_axes(x) -> bool:
    return isinstance(x, LogicalAxes)


def param_specs(model: PyTree, rules: ShardingRules) -> PyTree:
    """A pytree like `eqx.filter(model, is_array_like)` of each parameter's PartitionSpec."""
    return jax.tree.map(lambda a: rules.param_spec(a.names), logical_axes(model), is_leaf=_is_axes)


def param_shardings(model: PyTree, rules: ShardingRules, mesh: Mesh) -> PyTree:
    """Each parameter's NamedSharding on `mesh` (model may be abstract). Raises, before any
    compilation, for a dimension that does not divide by its mesh axes, naming the parameter."""
    check_mesh(rules, mesh)
    params = eqx.filter(model, is_array_like)

    def one(path, leaf, axes):
        spec = rules.param_spec(axes.names)
        check_divisible(jax.tree_util.keystr(path), leaf.shape, axes.names, spec, dict(mesh.shape))
        return NamedSharding(mesh, spec)

    return jax.tree_util.tree_map_with_path(one, params, logical_axes(model), is_leaf=_is_axes)


def shard_model(model: PyTree, rules: ShardingRules, mesh: Mesh) -> PyTree:
    """`model` with every parameter placed in its sharding (for a model that already exists on
    the host, e.g. a pretrained load; new models should use `init_sharded`). Always copies, so
    a training step that donates the placed model cannot delete `model`'s buffers."""
    params, static = eqx.partition(model, eqx.is_array)
    # A jitted identity, not device_put: its outputs never alias its (undonated) inputs.
    placed = jax.jit(lambda p: p, out_shardings=param_shardings(model, rules, mesh))(params)
    return eqx.combine(placed, static)


def init_sharded(
    config,
    rules: ShardingRules,
    mesh: Mesh,
    key: PRNGKeyArray,
    *,
    make: Callable[..., PyTree] | None = None,
) -> PyTree:
    """`make(config, key=key)` (default `zoo.Transformer`) created directly in its shardings:
    the shapes come from `eqx.filter_eval_shape` (no memory), then the initialiser is jitted
    with those shardings as `out_shardings`, so each device computes only its own shard."""
    if make is None:
        # Imported here because zoo.transformer imports shard (for `constrain`).
        from zoo.transformer import Transformer as make
    abstract = eqx.filter_eval_shape(make, config, key=key)
    shardings = param_shardings(abstract, rules, mesh)
    static = eqx.partition(abstract, is_array_like)[1]
    params = sharded_initialiser(make, config, shardings)(key)
    return eqx.combine(params, static)


def sharded_initialiser(make: Callable[..., PyTree], config, shardings: PyTree):
    """The jitted `key -> parameters` function behind `init_sharded` (exposed so tests and the
    plan can inspect its compiled memory)."""
    return jax.jit(
        lambda key: eqx.filter(make(config, key=key), eqx.is_array), out_shardings=shardings
    )


def replicated(mesh: Mesh) -> NamedSharding:
    """Every device holds the whole array (scalars such as a loss or a step count)."""
    return NamedSharding(mesh, PartitionSpec())


def opt_state_shardings(
    optimizer: optax.GradientTransformation, model: PyTree, rules: ShardingRules, mesh: Mesh
) -> PyTree:
    """Shardings of `optimizer.init(params)` (model may be abstract): moments shaped like a
    parameter take that parameter's sharding; everything else (step counts) is replicated."""
    abstract = jax.eval_shape(optimizer.init, eqx.filter(model, is_array_like))
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
