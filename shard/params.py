"""Shardings from logical axes: a model's parameters (by the rules' parameter mapping), other
named arrays such as a KV cache (by the activation mapping), placing them, creating a model
already sharded so that no device ever holds a whole parameter it should only hold a shard of,
and the optimizer state in the parameters' shardings. Nothing here knows a model: any pytree of
modules that name their axes (`logical_axes()`) works."""

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
    return _shardings(model, rules, mesh, rules.param_spec)


def array_shardings(tree: PyTree, rules: ShardingRules, mesh: Mesh) -> PyTree:
    """Each array's NamedSharding by the activation mapping (a KV cache: its batch split like
    the activations', its heads like theirs); same checks as `param_shardings`."""
    return _shardings(tree, rules, mesh, rules.partition_spec)


def _shardings(tree: PyTree, rules: ShardingRules, mesh: Mesh, spec_of) -> PyTree:
    check_mesh(rules, mesh)
    arrays = eqx.filter(tree, is_array_like)

    def one(path, leaf, axes):
        spec = spec_of(axes.names)
        check_divisible(jax.tree_util.keystr(path), leaf.shape, axes.names, spec, dict(mesh.shape))
        return NamedSharding(mesh, spec)

    return jax.tree_util.tree_map_with_path(one, arrays, logical_axes(tree), is_leaf=_is_axes)


def shard_model(model: PyTree, rules: ShardingRules, mesh: Mesh) -> PyTree:
    """`model` with every parameter placed in its sharding (for a model that already exists on
    the host; new or loaded models should be created in place: `init_sharded`,
    `zoo.load_pretrained(placement=...)`). Always copies, so a training step that donates the
    placed model cannot delete `model`'s buffers."""
    params, static = eqx.partition(model, eqx.is_array)
    # A jitted identity, not device_put: its outputs never alias its (undonated) inputs.
    placed = jax.jit(lambda p: p, out_shardings=param_shardings(model, rules, mesh))(params)
    return eqx.combine(placed, static)


def init_sharded(
    make: Callable[[PRNGKeyArray], PyTree], rules: ShardingRules, mesh: Mesh, key: PRNGKeyArray
) -> PyTree:
    """`make(key)` (e.g. `lambda key: zoo.Transformer(config, key=key)`) created directly in its
    shardings: the shapes come from `eqx.filter_eval_shape` (no memory), then the initialiser is
    jitted with those shardings as `out_shardings`, so each device computes only its own
    shard."""
    abstract = eqx.filter_eval_shape(make, key)
    shardings = param_shardings(abstract, rules, mesh)
    static = eqx.partition(abstract, is_array_like)[1]
    params = sharded_initialiser(make, shardings)(key)
    return eqx.combine(params, static)


def sharded_initialiser(make: Callable[[PRNGKeyArray], PyTree], shardings: PyTree):
    """The jitted `key -> parameters` function behind `init_sharded` (exposed so tests and the
    plan can inspect its compiled memory)."""
    return jax.jit(lambda key: eqx.filter(make(key), eqx.is_array), out_shardings=shardings)


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
