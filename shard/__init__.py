"""Named logical axes -> device mesh: rules and presets, the mesh, `Placement` (how every API takes
sharding), parameter, cache and optimizer-state shardings, sharded init, batches split over the
mesh, activation constraints and per-shard calls. This package knows no model: it reads the axis
names that modules declare (`logical_axes()`). The model-aware plan printer is training/plan.py."""

from shard.axes import LogicalAxes, logical_axes
from shard.batch import shard_batch
from shard.manual import active_specs, per_shard
from shard.mesh import mesh, parse_mesh
from shard.params import (
    array_shardings,
    init_opt_state,
    init_sharded,
    opt_state_shardings,
    param_shardings,
    param_specs,
    replicated,
    shard_model,
)
from shard.placement import Placement
from shard.rules import (
    LOGICAL_AXES,
    MESH_AXES,
    ShardingRules,
    constrain,
    default_rules,
    named_sharding,
    presets,
    rules_for,
    split_sequence,
    use_rules,
)

__all__ = [
    "LOGICAL_AXES",
    "MESH_AXES",
    "LogicalAxes",
    "Placement",
    "ShardingRules",
    "active_specs",
    "array_shardings",
    "constrain",
    "default_rules",
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
    "rules_for",
    "shard_batch",
    "shard_model",
    "split_sequence",
    "use_rules",
]
