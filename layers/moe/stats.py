"""Auxiliary outputs of an MoE layer: the router's losses and what to log.

- Load-balancing loss (Switch, Fedus et al. 2021, eq. 4; Mixtral): n_experts x sum_e f_e P_e,
  f_e the fraction of token->expert assignments that chose e, P_e the mean router probability of
  e. It is 1 for a uniform router and n_experts for a collapsed one. HF's Mixtral version sums f
  over the k slots, so it equals k times this one.
- Router z-loss (ST-MoE, Zoph et al. 2022, eq. 5): mean over tokens of logsumexp(logits)^2,
  keeping router logits small so the float32 softmax stays well-conditioned.
"""

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float

from layers.moe.router import Routing


class MoEStats(eqx.Module):
    """Per MoE layer; the model stacks them on a leading `layers` axis (MoE layers only, so a
    dense model has an empty one)."""

    load_balancing_loss: Float[Array, "*layers"]
    z_loss: Float[Array, "*layers"]
    expert_load: Float[Array, "*layers experts"]
    dropped_fraction: Float[Array, "*layers"]

    @classmethod
    def empty(cls, n_experts: int) -> "MoEStats":
        """Statistics of zero MoE layers (a dense model)."""
        zero = jnp.zeros((0,), jnp.float32)
        return cls(zero, zero, jnp.zeros((0, n_experts), jnp.float32), zero)


def routing_stats(routing: Routing, kept: Bool[Array, "*tokens topk"]) -> MoEStats:
    """Losses and load of one layer from its routing and the dispatcher's `kept` mask."""
    n_experts = routing.probs.shape[-1]
    chosen = jax.nn.one_hot(routing.experts, n_experts, dtype=jnp.float32)
    # f_e: fraction of all assignments (tokens x k) that chose e; sums to 1 over experts.
    expert_load = jnp.mean(chosen.reshape(-1, n_experts), axis=0)
    mean_prob = jnp.mean(routing.probs.reshape(-1, n_experts), axis=0)
    z = jax.nn.logsumexp(routing.logits, axis=-1)
    return MoEStats(
        load_balancing_loss=n_experts * jnp.sum(expert_load * mean_prob),
        z_loss=jnp.mean(jnp.square(z)),
        expert_load=expert_load,
        dropped_fraction=1.0 - jnp.mean(kept.astype(jnp.float32)),
    )


def aux_loss(
    stats: MoEStats, *, load_balancing_weight: float | int, z_loss_weight: float | int
) -> Float[Array, ""]:
    """The term a training loss adds: weighted load-balancing and z-losses, averaged over the MoE
    layers (so the weights do not depend on depth); exactly 0 for a model without MoE layers."""
    per_layer = load_balancing_weight * stats.load_balancing_loss + z_loss_weight * stats.z_loss
    return jnp.sum(per_layer) / max(per_layer.size, 1)
