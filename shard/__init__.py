"""Named logical axes -> device mesh: rules and presets, mesh helper, parameter and optimizer-state
shardings, sharded init, batches split over the mesh, and activation constraints. The training
step that uses them is training/step.py's (one implementation, with or without a mesh)."""

from shard.axes import LogicalAxes, logical_axes
from shard.batch import shard_batch
from shard.manual import active_specs, per_shard
from shard.mesh import mesh, parse_mesh
from shard.params import (
    init_opt_state,
    init_sharded,
    opt_state_shardings,
    param_shardings,
    param_specs,
    replicated,
    shard_model,
)
from shard.rules import (
    LOGICAL_AXES,
    MESH_AXES,
    ShardingRules,
    constrain,
    named_sharding,
    presets,
    use_rules,
)

__all__ = [
    "LOGICAL_AXES",
    "MESH_AXES",
    "LogicalAxes",
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
    "replicated",
    "shard_batch",
    "shard_model",
    "use_rules",
]
