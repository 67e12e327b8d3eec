"""LayerNorm (Ba et al. 2016) and RMSNorm (Zhang & Sennrich 2019), both computed in float32."""

import equinox as eqx
import jax
import jax.numpy as jnp
from jax.typing import DTypeLike
from jaxtyping import Array, Float


class LayerNorm(eqx.Module):
    """(x - mean) / sqrt(var + eps) * scale + bias over the last axis, in float32."""

    scale: Float[Array, " dim"]
    bias: Float[Array, " dim"] | None
    eps: float = eqx.field(static=True)
    axis_name: str = eqx.field(static=True)

    def __init__(
        self,
        dim: int,
        *,
        eps: float = 1e-5,
        use_bias: bool = True,
        axis_name: str = "embed",
        dtype: DTypeLike = jnp.float32,
    ):
        self.scale = jnp.ones((dim,), dtype)
        self.bias = jnp.zeros((dim,), dtype) if use_bias else None
        self.eps = eps
        self.axis_name = axis_name

    def __call__(self, x: Float[Array, "*batch dim"]) -> Float[Array, "*batch dim"]:
        x32 = x.astype(jnp.float32)
        mean = x32.mean(-1, keepdims=True)
        var = jnp.square(x32 - mean).mean(-1, keepdims=True)
        y = (x32 - mean) * jax.lax.rsqrt(var + self.eps) * self.scale.astype(jnp.float32)
        if self.bias is not None:
            y = y + self.bias.astype(jnp.float32)
        return y.astype(x.dtype)

    def logical_axes(self) -> dict[str, tuple[str, ...]]:
        names = {"scale": (self.axis_name,)}
        if self.bias is not None:
            names["bias"] = (self.axis_name,)
        return names


class RMSNorm(eqx.Module):
    """x / sqrt(mean(x^2) + eps) * scale over the last axis, in float32 (Llama's norm).

    `plus_one`: scale by (1 + scale) instead, in float32 (Gemma's norm: its checkpoints store the
    offset from 1, and adding 1 in float32 keeps the offset's precision in bfloat16 weights);
    the scale then starts at 0."""

    scale: Float[Array, " dim"]
    eps: float = eqx.field(static=True)
    axis_name: str = eqx.field(static=True)
    plus_one: bool = eqx.field(static=True)

    def __init__(
        self,
        dim: int,
        *,
        eps: float = 1e-5,
        axis_name: str = "embed",
        plus_one: bool = False,
        dtype: DTypeLike = jnp.float32,
    ):
        self.scale = (jnp.zeros if plus_one else jnp.ones)((dim,), dtype)
        self.eps = eps
        self.axis_name = axis_name
        self.plus_one = plus_one

    def __call__(self, x: Float[Array, "*batch dim"]) -> Float[Array, "*batch dim"]:
        x32 = x.astype(jnp.float32)
        y = x32 * jax.lax.rsqrt(jnp.square(x32).mean(-1, keepdims=True) + self.eps)
        scale = self.scale.astype(jnp.float32)
        return (y * (1.0 + scale if self.plus_one else scale)).astype(x.dtype)

    def logical_axes(self) -> dict[str, tuple[str, ...]]:
        return {"scale": (self.axis_name,)}
