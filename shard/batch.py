"""A host batch placed on the mesh: each array split over the devices by its logical axes."""

import jax
import numpy as np
from jax.sharding import Mesh
from jaxtyping import PyTree

from shard.rules import ShardingRules, check_divisible, named_sharding


def shard_batch(batch: PyTree, rules: ShardingRules, mesh: Mesh, axes: str = "batch seq") -> PyTree:
    """Place every array of `batch` (host arrays, the same global batch on every process) in
    the sharding of `axes`. Works across processes: each one fills only its own devices."""
    sharding = named_sharding(axes, rules, mesh)
    names = tuple(axes.split())

    def place(x):
        x = np.asarray(x)
        # `axes` name the leading dims; any further ones (a preference pair's side) are whole.
        leading = x.shape[: len(names)]
        check_divisible(f"batch array {x.shape}", leading, names, sharding.spec, dict(mesh.shape))
        return jax.make_array_from_callback(x.shape, sharding, lambda index: x[index])

    return jax.tree.map(place, batch)
