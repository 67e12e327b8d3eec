"""Logical axis names of every parameter: the one place that reads them off the model.

Each layer that owns arrays says what their dimensions are called (`logical_axes()`, in the
vocabulary `batch seq kv_seq embed heads kv_heads head_dim mlp vocab experts layers`). Arrays
stacked by `eqx.filter_vmap` carry extra leading dims, which are named `layers`.
"""

import dataclasses

import equinox as eqx
import jax
from jaxtyping import PyTree


@dataclasses.dataclass(frozen=True)
class LogicalAxes:
    """Names of an array's dimensions (a pytree leaf, unlike a plain tuple)."""

    names: tuple[str, ...]


def _child(node, key):
    if isinstance(key, jax.tree_util.GetAttrKey):
        return getattr(node, key.name)
    if isinstance(key, jax.tree_util.SequenceKey):
        return node[key.idx]
    if isinstance(key, jax.tree_util.DictKey):
        return node[key.key]
    raise TypeError(f"cannot follow pytree key {key!r}")


def is_array_like(leaf) -> bool:
    """A real array or an abstract one (from `eqx.filter_eval_shape`)."""
    return eqx.is_array(leaf) or isinstance(leaf, jax.ShapeDtypeStruct)


def is_float_array_like(leaf) -> bool:
    """A real or abstract floating-point array (what an optimizer can train)."""
    return is_array_like(leaf) and jax.numpy.issubdtype(leaf.dtype, jax.numpy.inexact)


def logical_axes(model: PyTree) -> PyTree:
    """A pytree shaped like `eqx.filter(model, is_array_like)` whose leaves are `LogicalAxes`;
    works on abstract models too, so shardings can be planned before any weight exists."""

    def name_leaf(path, leaf):
        owner = model
        for key in path[:-1]:
            owner = _child(owner, key)
        field = path[-1]
        if not (isinstance(field, jax.tree_util.GetAttrKey) and hasattr(owner, "logical_axes")):
            raise TypeError(
                f"array at {jax.tree_util.keystr(path)} belongs to {type(owner).__name__}, "
                "which does not name its axes (define logical_axes())"
            )
        names = owner.logical_axes()[field.name]
        stacked = leaf.ndim - len(names)
        if stacked < 0:
            raise ValueError(
                f"{jax.tree_util.keystr(path)}: {leaf.shape} has fewer dims than {names}"
            )
        return LogicalAxes(("layers",) * stacked + tuple(names))

    return jax.tree_util.tree_map_with_path(name_leaf, eqx.filter(model, is_array_like))
