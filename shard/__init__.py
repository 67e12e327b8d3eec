"""Named logical axes -> device mesh: rules, activation constraints, parameter axis names."""

from shard.axes import LogicalAxes, logical_axes
from shard.rules import ShardingRules, constrain, use_rules

__all__ = ["LogicalAxes", "ShardingRules", "constrain", "logical_axes", "use_rules"]
