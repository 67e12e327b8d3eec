"""Position-wise feed-forward blocks: GELU MLP (GPT-2) and the gated ones of Shazeer 2020:
SwiGLU (Llama) and GeGLU (Gemma), one module with the gate's activation as a parameter."""

from typing import Literal

import equinox as eqx
import jax
import jax.numpy as jnp
from jax.typing import DTypeLike
from jaxtyping import Array, Float, PRNGKeyArray

from layers.linear import Linear


class MLP(eqx.Module):
    """down(gelu(up(x))), with GPT-2's tanh-approximate GELU."""

    up: Linear
    down: Linear

    def __init__(
        self,
        d_model: int,
        d_ff: int,
        *,
        use_bias: bool = False,
        out_init_std: float | None = None,
        dtype: DTypeLike = jnp.float32,
        key: PRNGKeyArray,
    ):
        up_key, down_key = jax.random.split(key)
        self.up = Linear(
            d_model, d_ff, axes=("embed", "mlp"), use_bias=use_bias, dtype=dtype, key=up_key
        )
        self.down = Linear(
            d_ff,
            d_model,
            axes=("mlp", "embed"),
            use_bias=use_bias,
            init_std=out_init_std,
            dtype=dtype,
            key=down_key,
        )

    def __call__(self, x: Float[Array, "batch seq embed"]) -> Float[Array, "batch seq embed"]:
        return self.down(jax.nn.gelu(self.up(x), approximate=True))


GATE_ACTIVATIONS = {"silu": jax.nn.silu, "gelu_tanh": lambda x: jax.nn.gelu(x, approximate=True)}


class SwiGLU(eqx.Module):
    """down(act(gate(x)) * up(x)): with `activation="silu"` the SwiGLU of Llama, Mistral and
    SmolLM; with "gelu_tanh" (tanh-approximate GELU) the GeGLU of Gemma."""

    gate: Linear | None
    up: Linear | None
    down: Linear
    gate_up: Linear | None
    activation: Literal["silu", "gelu_tanh"] = eqx.field(static=True)

    def __init__(
        self,
        d_model: int,
        d_ff: int,
        *,
        use_bias: bool = False,
        out_init_std: float | None = None,
        activation: Literal["silu", "gelu_tanh"] = "silu",
        dtype: DTypeLike = jnp.float32,
        key: PRNGKeyArray,
    ):
        if activation not in GATE_ACTIVATIONS:
            raise ValueError(
                f"SwiGLU activation={activation!r} is unknown; choose one of "
                f"{sorted(GATE_ACTIVATIONS)}"
            )
        self.activation = activation
        gate_key, up_key, down_key = jax.random.split(key, 3)
        self.gate = Linear(
            d_model, d_ff, axes=("embed", "mlp"), use_bias=use_bias, dtype=dtype, key=gate_key
        )
        self.up = Linear(
            d_model, d_ff, axes=("embed", "mlp"), use_bias=use_bias, dtype=dtype, key=up_key
        )
        self.down = Linear(
            d_ff,
            d_model,
            axes=("mlp", "embed"),
            use_bias=use_bias,
            init_std=out_init_std,
            dtype=dtype,
            key=down_key,
        )
        self.gate_up = None

    def fused(self) -> "SwiGLU":
        """The same MLP with gate and up as one projection `[embed, 2, mlp]` (one matmul per
        step instead of two). A copy of both weights (keep the result, drop this one);
        adapters and quantized projections are refused (merge first)."""
        if self.gate_up is not None:
            return self
        if type(self.gate) is not Linear or type(self.up) is not Linear:
            raise ValueError(
                f"fusing gate/up needs plain Linear projections, got {type(self.gate).__name__} "
                f"and {type(self.up).__name__}; merge LoRA adapters (zoo.merge_adapter) and "
                "fuse the float model, not a quantized one"
            )
        stack = lambda a, b: jnp.stack([a, b], axis=-2)  # noqa: E731
        bias = None if self.gate.bias is None else stack(self.gate.bias, self.up.bias)
        gate_up = Linear.of(
            stack(self.gate.weight, self.up.weight), bias, n_in=1, axes=("embed", "gate_up", "mlp")
        )
        return eqx.tree_at(
            lambda m: (m.gate, m.up, m.gate_up),
            self,
            (None, None, gate_up),
            is_leaf=lambda x: x is None,
        )

    def unfused(self) -> "SwiGLU":
        """The inverse of `fused`: gate and up as separate projections again (a copy)."""
        if self.gate_up is None:
            return self
        w, b = self.gate_up.weight, self.gate_up.bias
        gate, up = (
            Linear.of(w[..., i, :], None if b is None else b[..., i, :], n_in=1,
                      axes=("embed", "mlp"))
            for i in (0, 1)
        )  # fmt: skip
        return eqx.tree_at(
            lambda m: (m.gate, m.up, m.gate_up),
            self,
            (gate, up, None),
            is_leaf=lambda x: x is None,
        )

    def __call__(self, x: Float[Array, "batch seq embed"]) -> Float[Array, "batch seq embed"]:
        if self.gate_up is None:
            gate, up = self.gate(x), self.up(x)
        else:
            both = self.gate_up(x)
            gate, up = both[..., 0, :], both[..., 1, :]
        return self.down(GATE_ACTIVATIONS[self.activation](gate) * up)
