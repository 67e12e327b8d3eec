"""Named logical axes -> device mesh: rules and presets, mesh helper, parameter specs, sharded
init, activation constraints and the pieces of a sharded training step."""

from shard.axes import LogicalAxes, logical_axes
from shard.manual import active_specs, per_shard
from shard.mesh import mesh, parse_mesh
from shard.params import init_sharded, param_shardings, param_specs, shard_model
from shard.rules import (
    LOGICAL_AXES,
    MESH_AXES,
    ShardingRules,
    constrain,
    named_sharding,
    presets,
    use_rules,
)
from shard.step import ShardedStep, init_opt_state, opt_state_shardings, shard_batch

__all__ = [
    "LOGICAL_AXES",
    "MESH_AXES",
    "LogicalAxes",
    "ShardedStep",
    "ShardingRules",
    "active_specs",
    "constrain",
    "init_opt_state",
    "init_sharded",
    "logical_axes",
    "mesh",
    "named_sharding",
    "opt_state_shardings",
    "param_shardings",
    "param_specs",
    "parse_mesh",
    "per_shard",
    "presets",
    "shard_batch",
    "shard_model",
    "use_rules",
]
