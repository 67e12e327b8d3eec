"""Code that XLA cannot partition (a Pallas kernel is an opaque custom call, which XLA would
feed by all-gathering its inputs to every device) run per shard with `jax.shard_map` under the
active rules: each device calls it on its own slice, named by logical axes as in `constrain`.

`jax.shard_map` with `in_specs`, `out_specs`, `mesh` and `check_vma` given by keyword exists on
JAX 0.11 and 0.12 alike (`jax.experimental.shard_map` is deprecated).
"""

from collections.abc import Callable

import jax
from jax.sharding import PartitionSpec
from jaxtyping import PyTree

from shard.rules import active, check_divisible, mesh_axes_of


def active_specs(*axes: str) -> tuple[PartitionSpec, ...] | None:
    """One PartitionSpec per activation named by `axes` (e.g. "batch seq heads head_dim") under
    the active rules; None when no rules are active."""
    current = active()
    if current is None:
        return None
    rules, _ = current
    return tuple(rules.partition_spec(tuple(names.split())) for names in axes)


def per_shard(f: Callable, in_axes: PyTree[str], out_axes: PyTree[str]) -> Callable:
    """`f` run on each device's shard of its arguments under the active rules; `f` itself when
    no rules are active. `in_axes` / `out_axes` name the leading dims of the arguments / outputs
    (a string may stand for a whole subtree, e.g. "batch" for every array of a mask; unnamed
    trailing dims are whole on every device). `f` must need no communication: it sees only its
    shard, so whatever it computes across a split dim is wrong."""
    current = active()
    if current is None:
        return f
    rules, mesh = current

    def spec(names: str) -> PartitionSpec:
        return rules.partition_spec(tuple(names.split()))

    def full_spec(names: str) -> PartitionSpec:
        # Mesh axes of size 1 that the spec leaves out are added to its first dim, where they
        # split nothing: an array left whole on a mesh axis has its gradient summed over that
        # axis by shard_map's transpose, which on a size-1 axis is a useless all-reduce.
        first, *rest = spec(names)
        named = set(mesh_axes_of(first)).union(*map(mesh_axes_of, rest))
        idle = tuple(a for a, size in mesh.shape.items() if size == 1 and a not in named)
        return PartitionSpec((*mesh_axes_of(first), *idle) or None, *rest)

    def check(names: str, subtree: PyTree) -> None:
        named, sizes = tuple(names.split()), dict(mesh.shape)
        for x in jax.tree.leaves(subtree):
            what = f"per-shard call on {x.shape}"
            check_divisible(what, x.shape[: len(named)], named, spec(names), sizes)

    def run(*args):
        jax.tree.map(check, in_axes, args)
        # check_vma=False: with the check on, a Pallas call must declare for every output over
        # which mesh axes it varies. Without it the transpose divides the cotangent of an output
        # that is whole on a mesh axis by that axis's size and sums the input cotangents over
        # it, so gradients stay exact.
        mapped = jax.shard_map(
            f,
            mesh=mesh,
            in_specs=jax.tree.map(full_spec, in_axes),
            out_specs=jax.tree.map(full_spec, out_axes),
            check_vma=False,
        )
        return mapped(*args)

    return run
