"""Rules that map logical axis names to mesh axis names, and the active (rules, mesh) context."""

import contextlib
import contextvars
import dataclasses

import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec
from jaxtyping import Array


@dataclasses.dataclass(frozen=True)
class ShardingRules:
    """`mapping` pairs each logical axis with a mesh axis (or a tuple of them); unnamed axes are
    replicated. Two logical axes may not share a mesh axis inside one array's spec."""

    mapping: tuple[tuple[str, str | tuple[str, ...] | None], ...] = ()

    def mesh_axes(self, logical: str) -> str | tuple[str, ...] | None:
        return dict(self.mapping).get(logical)

    def partition_spec(self, names: tuple[str, ...]) -> PartitionSpec:
        """The PartitionSpec for an array whose dims are called `names`."""
        used: dict[str, str] = {}
        spec = []
        for name in names:
            target = self.mesh_axes(name)
            for mesh_axis in (target,) if isinstance(target, str) else (target or ()):
                if mesh_axis in used:
                    raise ValueError(
                        f"logical axes {used[mesh_axis]!r} and {name!r} both map to mesh axis "
                        f"{mesh_axis!r} in one array {names}; change the rules"
                    )
                used[mesh_axis] = name
            spec.append(target)
        return PartitionSpec(*spec)


_ACTIVE: contextvars.ContextVar[tuple[ShardingRules, Mesh] | None] = contextvars.ContextVar(
    "active_sharding", default=None
)


@contextlib.contextmanager
def use_rules(rules: ShardingRules, mesh: Mesh):
    """Make `constrain` place activations on `mesh` according to `rules` inside this block."""
    token = _ACTIVE.set((rules, mesh))
    try:
        yield
    finally:
        _ACTIVE.reset(token)


def constrain(x: Array, axes: str) -> Array:
    """Pin activation `x` (dims named by `axes`, e.g. "batch seq embed") to its sharding under
    the active rules; with no active rules it returns x unchanged, so layers run anywhere."""
    active = _ACTIVE.get()
    if active is None:
        return x
    rules, mesh = active
    names = tuple(axes.split())
    if len(names) != x.ndim:
        raise ValueError(f"constrain: {axes!r} names {len(names)} dims but x has shape {x.shape}")
    return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, rules.partition_spec(names)))
