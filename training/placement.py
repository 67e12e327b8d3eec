"""Where a run's state and batches live: the default device, or a mesh with sharding rules.

`Placement()` puts everything on one device. `Placement(mesh, rules)` (train.py's
`--mesh fsdp=4,tensor=2 --rules fsdp_tp`) creates the model directly in its shardings
(`shard.init_sharded`: no device ever holds a whole parameter it should hold a shard of), the
optimizer state in the parameters' shardings (`shard.init_opt_state`), splits each batch over the
batch axes (`shard.shard_batch`) and gives the jitted step its in/out shardings. Every check a
mesh makes (size against the device count, divisibility of each dimension) runs here, before
anything compiles.
"""

import contextlib
from typing import Any

import equinox as eqx
import jax
import optax
from jax.sharding import Mesh

import shard
from shard.plan import default_rules
from shard.rules import ShardingRules
from zoo import Config, Transformer


class Placement:
    def __init__(self, mesh: Mesh | None = None, rules: ShardingRules | None = None):
        if (mesh is None) != (rules is None):
            raise ValueError("a Placement needs both a mesh and sharding rules, or neither")
        self.mesh, self.rules = mesh, rules

    @classmethod
    def from_flags(cls, mesh: str | None, rules: str | None) -> "Placement":
        """`--mesh fsdp=4,tensor=2` and `--rules NAME` (default: the preset the mesh's shape
        suggests, `shard.plan.default_rules`). No mesh: one device (`--rules` is refused)."""
        if mesh is None:
            if rules is not None:
                raise ValueError(f"--rules {rules!r} needs a --mesh, e.g. --mesh fsdp=8")
            return cls()
        sizes = shard.parse_mesh(mesh)
        try:
            device_mesh = shard.mesh(**sizes)
        except ValueError as error:
            hint = ""
            if jax.devices()[0].platform == "cpu":
                hint = " (on a CPU, XLA_FLAGS=--xla_force_host_platform_device_count=N fakes N)"
            raise ValueError(f"--mesh {mesh!r}: {error}{hint}") from error
        return cls(device_mesh, ShardingRules.preset(rules or default_rules(sizes)))

    @property
    def sharded(self) -> bool:
        return self.mesh is not None

    @property
    def devices(self) -> int:
        return self.mesh.size if self.sharded else 1

    def describe(self) -> str:
        if not self.sharded:
            return f"one device ({jax.devices()[0].platform})"
        return f"mesh {dict(self.mesh.shape)}, rules {self.rules}"

    def init_model(self, config: Config, key) -> Transformer:
        if not self.sharded:
            return Transformer(config, key=key)
        return shard.init_sharded(config, self.rules, self.mesh, key)

    def place_model(self, model: Transformer) -> Transformer:
        """A model built on the host (a pretrained load) put in its shardings."""
        if not self.sharded:
            return model
        return shard.shard_model(model, self.rules, self.mesh)

    def init_opt_state(self, optimizer: optax.GradientTransformation, model: Transformer):
        if not self.sharded:
            return jax.device_put(optimizer.init(eqx.filter(model, eqx.is_inexact_array)))
        return shard.init_opt_state(optimizer, model, self.rules, self.mesh)

    def shardings(self, optimizer: optax.GradientTransformation, model: Transformer):
        """(parameters, optimizer state, batch) shardings for the step's jit; None without a
        mesh (the default device)."""
        if not self.sharded:
            return None
        return (
            shard.param_shardings(model, self.rules, self.mesh),
            shard.opt_state_shardings(optimizer, model, self.rules, self.mesh),
            shard.named_sharding("batch seq", self.rules, self.mesh),
        )

    def put(self, tree: Any, shardings: Any = None) -> Any:
        """Host arrays (a restored checkpoint) onto the device(s), in `shardings` if given."""
        return jax.device_put(tree, shardings if self.sharded else None)

    def batch(self, batch: Any) -> Any:
        """A host batch ([batch, seq] arrays) split over the mesh's batch axes."""
        if not self.sharded:
            return jax.device_put(batch)
        return shard.shard_batch(batch, self.rules, self.mesh)

    def context(self):
        """Active while the step is traced, so `shard.constrain` places the activations."""
        if not self.sharded:
            return contextlib.nullcontext()
        return shard.use_rules(self.rules, self.mesh)
