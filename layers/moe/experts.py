"""N SwiGLU feed-forward experts held as stacked weights, so one grouped or batched matmul runs
them all (Mixtral's experts; fine-grained DeepSeek-MoE experts are the same with a small `mlp`).

Weights are `[experts, embed, mlp]` (gate, up) and `[experts, mlp, embed]` (down): HF Mixtral's
`experts.E.w1/w3.weight` transposed and stacked over E give gate/up, `w2.weight` transposed gives
down.
"""

import equinox as eqx
import jax
import jax.numpy as jnp
from jax.typing import DTypeLike
from jaxtyping import Array, Float, Int, PRNGKeyArray

from layers.init import scaled_normal


class Experts(eqx.Module):
    """down_e(silu(x · gate_e) * (x · up_e)) for each expert e."""

    gate: Float[Array, "experts embed mlp"]
    up: Float[Array, "experts embed mlp"]
    down: Float[Array, "experts mlp embed"]

    def __init__(
        self,
        n_experts: int,
        d_model: int,
        d_ff: int,
        *,
        out_init_std: float | None = None,
        dtype: DTypeLike = jnp.float32,
        key: PRNGKeyArray,
    ):
        gate_key, up_key, down_key = jax.random.split(key, 3)
        in_std = d_model**-0.5
        out_std = out_init_std if out_init_std is not None else d_ff**-0.5
        shape_in, shape_out = (n_experts, d_model, d_ff), (n_experts, d_ff, d_model)
        self.gate = scaled_normal(gate_key, in_std, shape_in, dtype)
        self.up = scaled_normal(up_key, in_std, shape_in, dtype)
        self.down = scaled_normal(down_key, out_std, shape_out, dtype)

    @staticmethod
    def of(
        gate: Float[Array, "*layers experts embed mlp"],
        up: Float[Array, "*layers experts embed mlp"],
        down: Float[Array, "*layers experts mlp embed"],
    ) -> "Experts":
        """Experts holding these arrays (no initialisation; stacked layers may lead)."""
        experts = object.__new__(Experts)
        for name, value in [("gate", gate), ("up", up), ("down", down)]:
            object.__setattr__(experts, name, value)
        return experts

    @property
    def n_experts(self) -> int:
        return self.gate.shape[0]

    def grouped(
        self, x: Float[Array, "rows embed"], group_sizes: Int[Array, " experts"]
    ) -> Float[Array, "rows embed"]:
        """Rows sorted by expert, `group_sizes[e]` of them for expert e: three grouped matmuls
        (`jax.lax.ragged_dot`), each row multiplied by its own expert's weights only."""
        dtype = x.dtype
        gate = jax.lax.ragged_dot(x, self.gate.astype(dtype), group_sizes)
        up = jax.lax.ragged_dot(x, self.up.astype(dtype), group_sizes)
        return jax.lax.ragged_dot(jax.nn.silu(gate) * up, self.down.astype(dtype), group_sizes)

    def batched(
        self, x: Float[Array, "experts *slots embed"]
    ) -> Float[Array, "experts *slots embed"]:
        """A buffer of rows per expert (the capacity layout): batched matmuls over experts."""
        dtype = x.dtype
        gate = jnp.einsum("e...d,edf->e...f", x, self.gate.astype(dtype))
        up = jnp.einsum("e...d,edf->e...f", x, self.up.astype(dtype))
        return jnp.einsum("e...f,efd->e...d", jax.nn.silu(gate) * up, self.down.astype(dtype))

    def logical_axes(self) -> dict[str, tuple[str, ...]]:
        return {
            "gate": ("experts", "embed", "mlp"),
            "up": ("experts", "embed", "mlp"),
            "down": ("experts", "mlp", "embed"),
        }
