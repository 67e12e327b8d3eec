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

    gate: Linear
    up: Linear
    down: Linear
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

    def __call__(self, x: Float[Array, "batch seq embed"]) -> Float[Array, "batch seq embed"]:
        return self.down(GATE_ACTIVATIONS[self.activation](self.gate(x)) * self.up(x))
