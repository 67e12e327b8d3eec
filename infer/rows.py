"""How the arrays of an engine's rows lie on the mesh. What one step program hands the next (the
engine's forward to its sampling program, a draft model's catch-up to its proposals) is pinned to
one sharding, so the receiving program, compiled once, takes it whatever the step's shape."""

import jax
from jax.sharding import NamedSharding, PartitionSpec

from shard import Placement


def row_sharding(placement: Placement, ndim: int, *, vocab: bool = False):
    """An array of the engine's rows: its leading dim split over the batch axes, a trailing
    vocabulary dim (`vocab`) as the rules split it, the rest whole (None without a mesh)."""
    if not placement.sharded:
        return None
    (batch,), (split,) = (placement.rules.partition_spec((n,)) for n in ("batch", "vocab"))
    spec = (batch, *[None] * (ndim - 1 - vocab), *[split] * vocab)
    return NamedSharding(placement.mesh, PartitionSpec(*spec))


def committed(tree):
    """`tree`'s arrays committed to the devices they lie on, as a program's outputs are: a jitted
    program (a draft model's, compiled by its first call) then lowers on its first call what it
    lowers on every later one (an uncommitted argument is another lowering, another compile)."""
    return jax.tree.map(lambda x: jax.device_put(x, x.sharding), tree)


def pin_rows(tree, placement: Placement, *, vocab: bool = False):
    """Inside a program: `tree`'s arrays pinned to `row_sharding`."""
    if not placement.sharded:
        return tree
    return jax.tree.map(
        lambda x: jax.lax.with_sharding_constraint(x, row_sharding(placement, x.ndim, vocab=vocab)),
        tree,
    )
