"""Two ways to send tokens to their experts and bring the results back, behind one interface:
`dispatch(experts, x, expert_ids, weights) -> Dispatched(y, kept)`.

- `Dropless` (MegaBlocks, Gale et al. 2022): sort the token->expert assignments by expert, run
  grouped matmuls over the ragged groups (`jax.lax.ragged_dot`), unsort. No token is dropped and
  no FLOP is spent on padding, but the group sizes are data-dependent.
- `Capacity` (GShard, Lepikhin et al. 2020; Switch): each expert takes at most `capacity` tokens
  of each sequence; one-hot dispatch/combine einsums move tokens into a dense
  `[experts, batch, capacity, embed]` buffer and back. Static shapes: with `experts` sharded over
  one mesh axis and `batch` over another, the dispatch einsum becomes an all-to-all (the
  `shard.constrain` calls name the two layouts; the buffer's sequence dim is `expert_batch`,
  see shard/rules.py). Assignments
  beyond an expert's capacity are dropped (the token keeps only its residual path for that
  expert) and reported in `kept`.
"""

import math

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int

from layers.moe.experts import Experts
from layers.moe.quantized import QuantizedExperts
from shard.rules import constrain

# The capacity buffer's layout: experts split over their mesh axis, sequences over the rest.
BUFFER = "experts expert_batch capacity embed"


class Dispatched(eqx.Module):
    """The experts' combined output per token, and which assignments were actually computed."""

    y: Float[Array, "batch seq embed"]
    kept: Bool[Array, "batch seq topk"]


class Dropless(eqx.Module):
    """Sort by expert, grouped matmuls, unsort: every assignment is computed."""

    def __call__(
        self,
        experts: Experts | QuantizedExperts,
        x: Float[Array, "batch seq embed"],
        expert_ids: Int[Array, "batch seq topk"],
        weights: Float[Array, "batch seq topk"],
    ) -> Dispatched:
        batch, seq, d_model = x.shape
        k = expert_ids.shape[-1]
        flat_ids = expert_ids.reshape(-1)
        # Assignment a = token * k + slot; a stable sort keeps token order inside each group.
        order = jnp.argsort(flat_ids, stable=True)
        rows = x.reshape(batch * seq, d_model)[order // k]
        group_sizes = jnp.bincount(flat_ids, length=experts.n_experts).astype(jnp.int32)
        out = experts.grouped(rows, group_sizes)[jnp.argsort(order)]
        out = out.reshape(batch, seq, k, d_model)
        y = jnp.einsum("bskd,bsk->bsd", out, weights.astype(x.dtype))
        return Dispatched(y=y, kept=jnp.ones(expert_ids.shape, bool))


def expert_capacity(seq: int, n_experts_per_token: int, n_experts: int, factor: float) -> int:
    """Slots per expert per sequence: ceil(factor x seq x k / experts), at most seq (an expert
    cannot receive a token twice), at least 1."""
    slots = math.ceil(factor * seq * n_experts_per_token / n_experts)
    return max(1, min(seq, slots))


class Capacity(eqx.Module):
    """Fixed capacity per expert and sequence; first choices claim slots before second choices
    (GShard's priority), earlier tokens before later ones."""

    capacity_factor: float = eqx.field(static=True)

    def __check_init__(self):
        if not self.capacity_factor > 0:
            raise ValueError(f"capacity_factor must be > 0, got {self.capacity_factor}")

    def __call__(
        self,
        experts: Experts | QuantizedExperts,
        x: Float[Array, "batch seq embed"],
        expert_ids: Int[Array, "batch seq topk"],
        weights: Float[Array, "batch seq topk"],
    ) -> Dispatched:
        batch, seq, _ = x.shape
        x = constrain(x, "batch seq embed")
        k, n_experts = expert_ids.shape[-1], experts.n_experts
        capacity = expert_capacity(seq, k, n_experts, self.capacity_factor)
        chosen = jax.nn.one_hot(expert_ids, n_experts, dtype=jnp.int32)  # [b, s, k, e]
        # Running count per expert in priority order (slot-major: all first choices first).
        by_priority = chosen.transpose(0, 2, 1, 3).reshape(batch, k * seq, n_experts)
        position = jnp.cumsum(by_priority, axis=1).reshape(batch, k, seq, n_experts) - 1
        position = jnp.sum(position.transpose(0, 2, 1, 3) * chosen, axis=-1)  # [b, s, k]
        kept = position < capacity
        # one_hot of a position >= capacity is all zeros: dropped assignments vanish here.
        slot = jax.nn.one_hot(position, capacity, dtype=x.dtype)  # [b, s, k, c]
        chosen = chosen.astype(x.dtype)
        dispatch = jnp.einsum("bske,bskc->bsec", chosen, slot)
        combine = jnp.einsum("bske,bskc,bsk->bsec", chosen, slot, weights.astype(x.dtype))
        # All-to-all in: each device keeps its own experts' slots of more sequences.
        expert_in = constrain(jnp.einsum("bsec,bsd->ebcd", dispatch, x), BUFFER)
        expert_out = constrain(experts.batched(expert_in), BUFFER)
        # All-to-all out: the results go back to their tokens' devices.
        y = constrain(jnp.einsum("bsec,ebcd->bsd", combine, expert_out), "batch seq embed")
        return Dispatched(y=y, kept=kept)
