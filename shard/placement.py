"""`Placement`: where arrays live, the one way every API takes sharding (model creation and
loading, the training step, generation, checkpoints).

`Placement()` is the default device. `Placement(mesh, rules)` (train.py's `--mesh fsdp=4,tensor=2
--rules fsdp_tp`) creates models directly in their shardings (`init_sharded`: no device ever holds
a whole parameter it should hold a shard of), places parameters by the rules' parameter mapping
and KV caches and batches by the activation mapping, and makes `constrain` active while a step is
traced. Every check a mesh makes (size against the device count, divisibility of each dimension)
runs before anything compiles. Frozen and hashable, so it can be a static argument of a jitted
function.
"""

import contextlib
import dataclasses
import math
from collections.abc import Callable
from typing import Any

import equinox as eqx
import jax
import optax
from jax.sharding import Mesh, NamedSharding
from jaxtyping import PRNGKeyArray, PyTree

from shard.batch import process_rows, shard_batch
from shard.mesh import mesh as make_mesh
from shard.mesh import parse_mesh
from shard.params import (
    array_shardings,
    init_opt_state,
    init_sharded,
    opt_state_shardings,
    param_shardings,
    replicated,
    shard_model,
)
from shard.rules import (
    ShardingRules,
    mesh_axes_of,
    named_sharding,
    rules_for,
    use_rules,
)


@dataclasses.dataclass(frozen=True)
class Placement:
    mesh: Mesh | None = None
    rules: ShardingRules | None = None

    def __post_init__(self):
        if (self.mesh is None) != (self.rules is None):
            raise ValueError("a Placement needs both a mesh and sharding rules, or neither")

    @classmethod
    def from_flags(cls, mesh: str | None, rules: str | None) -> "Placement":
        """`--mesh fsdp=4,tensor=2` and `--rules NAME` (default: the preset the mesh's shape
        suggests, `shard.rules.default_rules`). No mesh: one device (`--rules` is refused).
        A `context` axis larger than 1 also splits the activations' sequence over it
        (`shard.rules.rules_for`)."""
        if mesh is None:
            if rules is not None:
                raise ValueError(f"--rules {rules!r} needs a --mesh, e.g. --mesh fsdp=8")
            return cls()
        sizes = parse_mesh(mesh)
        try:
            device_mesh = make_mesh(**sizes)
        except ValueError as error:
            hint = ""
            if jax.devices()[0].platform == "cpu":
                hint = " (on a CPU, XLA_FLAGS=--xla_force_host_platform_device_count=N fakes N)"
            raise ValueError(f"--mesh {mesh!r}: {error}{hint}") from error
        return cls(device_mesh, rules_for(sizes, rules))

    @property
    def sharded(self) -> bool:
        return self.mesh is not None

    @property
    def sequence_shards(self) -> int:
        """Into how many pieces the rules split each sequence (context parallelism); 1 when
        the sequence is whole."""
        if not self.sharded:
            return 1
        axes = mesh_axes_of(self.rules.mesh_axes("seq"))
        return math.prod(self.mesh.shape[a] for a in axes)

    @property
    def devices(self) -> int:
        return self.mesh.size if self.sharded else 1

    def describe(self) -> str:
        if not self.sharded:
            return f"one device ({jax.devices()[0].platform})"
        return f"mesh {dict(self.mesh.shape)}, rules {self.rules}"

    def init(self, make: Callable[[PRNGKeyArray], PyTree], key: PRNGKeyArray) -> PyTree:
        """`make(key)` created in its shardings (on the default device without a mesh)."""
        if not self.sharded:
            return make(key)
        return init_sharded(make, self.rules, self.mesh, key)

    def place(self, model: PyTree) -> PyTree:
        """A model that exists on the host put in its shardings (a copy)."""
        return shard_model(model, self.rules, self.mesh) if self.sharded else model

    def param_shardings(self, model: PyTree) -> PyTree | None:
        """Each parameter's sharding (model may be abstract); None without a mesh."""
        return param_shardings(model, self.rules, self.mesh) if self.sharded else None

    def array_shardings(self, tree: PyTree) -> PyTree | None:
        """Each named array's sharding by the activation mapping (a KV cache); None without a
        mesh."""
        return array_shardings(tree, self.rules, self.mesh) if self.sharded else None

    def place_arrays(self, tree: PyTree) -> PyTree:
        """`tree` (e.g. a KV cache) placed by its arrays' logical axes."""
        if not self.sharded:
            return tree
        arrays, static = eqx.partition(tree, eqx.is_array)
        return eqx.combine(jax.device_put(arrays, self.array_shardings(tree)), static)

    def constrain_arrays(self, tree: PyTree) -> PyTree:
        """Inside a traced function: pin `tree`'s arrays (a KV cache) to their shardings."""
        if not self.sharded:
            return tree
        arrays, static = eqx.partition(tree, eqx.is_array)
        pinned = jax.lax.with_sharding_constraint(arrays, self.array_shardings(tree))
        return eqx.combine(pinned, static)

    def init_opt_state(self, optimizer: optax.GradientTransformation, params: PyTree) -> PyTree:
        """`optimizer.init(params)` with the state in the parameters' shardings."""
        if not self.sharded:
            return jax.device_put(optimizer.init(eqx.filter(params, eqx.is_inexact_array)))
        return init_opt_state(optimizer, params, self.rules, self.mesh)

    def opt_state_shardings(
        self, optimizer: optax.GradientTransformation, params: PyTree
    ) -> PyTree | None:
        if not self.sharded:
            return None
        return opt_state_shardings(optimizer, params, self.rules, self.mesh)

    def put(self, tree: Any, shardings: Any = None) -> Any:
        """Host arrays (a restored checkpoint) onto the device(s), in `shardings` if given."""
        return jax.device_put(tree, shardings if self.sharded else None)

    def batch_sharding(self, axes: str = "batch seq") -> NamedSharding | None:
        return named_sharding(axes, self.rules, self.mesh) if self.sharded else None

    def replicated(self) -> NamedSharding | None:
        return replicated(self.mesh) if self.sharded else None

    def batch(
        self,
        batch: Any,
        axes: str = "batch seq",
        *,
        rows: slice | None = None,
        total: int | None = None,
    ) -> Any:
        """Host arrays (`axes` naming their leading dims) split over the mesh's batch axes:
        the whole batch, or, given `rows` (`process_rows`), this process's rows of a batch of
        `total`."""
        if not self.sharded:
            return jax.device_put(batch)
        return shard_batch(batch, self.rules, self.mesh, axes, rows=rows, total=total)

    def process_rows(self, batch: int, seq: int) -> slice:
        """The rows of a `[batch, seq]` batch this process's devices hold: all of them on one
        process, its share of the batch axes with several."""
        if not self.sharded or jax.process_count() == 1:
            return slice(0, batch)
        return process_rows(self.batch_sharding(), (batch, seq))

    def context(self):
        """Active while a step is traced, so `shard.constrain` places the activations."""
        if not self.sharded:
            return contextlib.nullcontext()
        return use_rules(self.rules, self.mesh)
