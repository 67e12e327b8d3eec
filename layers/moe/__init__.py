"""Mixture of experts: router, stacked experts (float or packed), dropless and capacity dispatch,
aux losses."""

from layers.moe.dispatch import Capacity, Dispatched, Dropless, expert_capacity
from layers.moe.experts import Experts
from layers.moe.layer import Dispatch, MoE
from layers.moe.quantized import QuantizedExperts
from layers.moe.router import Router, Routing
from layers.moe.stats import MoEStats, aux_loss, routing_stats

__all__ = [
    "Capacity",
    "Dispatch",
    "Dispatched",
    "Dropless",
    "Experts",
    "MoE",
    "MoEStats",
    "QuantizedExperts",
    "Router",
    "Routing",
    "aux_loss",
    "expert_capacity",
    "routing_stats",
]
