"""LayerNorm (Ba et al. 2016) and RMSNorm (Zhang & Sennrich 2019), both computed in float32, each
token's statistics summed in an order of its own (`row_mean`)."""

import equinox as eqx
import jax
import jax.numpy as jnp
from jax.typing import DTypeLike
from jaxtyping import Array, Float

from shard.rules import active


def row_mean(x: Float[Array, "*batch dim"]) -> Float[Array, "*batch 1"]:
    """The mean over the last axis, summed in an order fixed by `dim` alone: halves added
    elementwise while the width is even, then the odd rest left to right (pairwise summation).
    Each row's bits depend on that row alone. XLA:CPU picks a reduction's order by the whole
    array's shape, so a token's norm changed in its last bits with the number of tokens beside
    it, which int8 activations' rounding turns into other greedy tokens (an engine's tokens
    then depended on what else its steps held; bench/RESULTS.md, "Int8 activations sixteen
    rows a vector"). Under a mesh's rules (`shard.rules.active`) XLA's reduce: with the halves,
    train.py's pipeline run on 8 fake devices aborted in a collective-permute's rendezvous."""
    if active() is not None:
        return x.mean(-1, keepdims=True)
    total = x
    while total.shape[-1] % 2 == 0:
        half = total.shape[-1] // 2
        total = total[..., :half] + total[..., half:]
    rest = total[..., :1]
    for i in range(1, total.shape[-1]):
        rest = rest + total[..., i : i + 1]
    return rest / x.shape[-1]


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
        mean = row_mean(x32)
        var = row_mean(jnp.square(x32 - mean))
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
        y = x32 * jax.lax.rsqrt(row_mean(jnp.square(x32)) + self.eps)
        scale = self.scale.astype(jnp.float32)
        return (y * (1.0 + scale if self.plus_one else scale)).astype(x.dtype)

    def logical_axes(self) -> dict[str, tuple[str, ...]]:
        return {"scale": (self.axis_name,)}
