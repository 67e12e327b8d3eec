"""A host batch placed on the mesh: each array split over the devices by its logical axes."""

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jaxtyping import PyTree

from shard.rules import ShardingRules, check_divisible, named_sharding


def shard_batch(
    batch: PyTree,
    rules: ShardingRules,
    mesh: Mesh,
    axes: str = "batch seq",
    *,
    rows: slice | None = None,
    total: int | None = None,
) -> PyTree:
    """Place every array of `batch` (host arrays) in the sharding of `axes`. Each process fills
    only its own devices: from the whole batch, or, given `rows`, from rows [start, stop) of a
    batch of `total` rows, all that its devices hold (`process_rows`)."""
    sharding = named_sharding(axes, rules, mesh)
    names = tuple(axes.split())
    start = 0 if rows is None else rows.start

    def place(x):
        x = np.asarray(x)
        shape = x.shape if rows is None else (total, *x.shape[1:])
        # `axes` name the leading dims; any further ones (a preference pair's side) are whole.
        leading = shape[: len(names)]
        check_divisible(f"batch array {shape}", leading, names, sharding.spec, dict(mesh.shape))

        def fetch(index):
            first = index[0]
            local = slice(
                (first.start or 0) - start, (shape[0] if first.stop is None else first.stop) - start
            )
            return x[(local, *index[1:])]

        return jax.make_array_from_callback(shape, sharding, fetch)

    return jax.tree.map(place, batch)


def process_rows(sharding: NamedSharding, shape: tuple[int, ...]) -> slice:
    """The rows [start, stop) of a `shape` batch in `sharding` that this process's devices hold
    (all of them in a one-process run): what it needs to load."""
    held = [index[0] for index in sharding.addressable_devices_indices_map(shape).values()]
    starts = [r.start or 0 for r in held]
    stops = [shape[0] if r.stop is None else r.stop for r in held]
    first, last = min(starts), max(stops)
    covered = set().union(*(range(a, b) for a, b in zip(starts, stops, strict=True)))
    if covered != set(range(first, last)):
        raise ValueError(
            f"this process's devices hold rows {sorted(covered)} of a batch of {shape[0]}, not "
            "one contiguous range; order the mesh so each process's devices are neighbours "
            "along the batch axes"
        )
    return slice(first, last)
