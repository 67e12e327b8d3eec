"""LoRA (Hu et al. 2021, "LoRA: Low-Rank Adaptation of Large Language Models"): a frozen
projection plus a trainable low-rank update, y = base(x) + (alpha / rank) · (x · A) · B."""

import math
import string

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jax.typing import DTypeLike
from jaxtyping import Array, Float, PRNGKeyArray

from layers.init import scaled_normal
from layers.linear import Linear
from layers.quantized import QuantizedLinear


class AroundProjection(eqx.Module):
    """A module around a projection `base` (LoRA, a bank of adapters): it takes the base's
    shapes and logical axes, so it can stand wherever the base did."""

    base: eqx.AbstractVar[Linear | QuantizedLinear]

    @property
    def in_shape(self) -> tuple[int, ...]:
        return self.base.in_shape

    @property
    def out_shape(self) -> tuple[int, ...]:
        return self.base.out_shape

    @property
    def axes(self) -> tuple[str, ...]:
        return self.base.axes


class LoRA(AroundProjection):
    """`base(x) + scale · dropout(x) · A · B` with `scale = alpha / rank`.

    `base` is the wrapped projection, kept whole as an attribute: LoRA uses only its
    `__call__(x, dtype=)`, `in_shape`, `out_shape` and `axes`, so another projection with those
    (a `QuantizedLinear`, QLoRA's frozen base) can take its place; only `merged()` needs a
    `Linear`.

    Shapes follow the base's multi-dim layout: A is `[*in_shape, rank]`, B `[rank, *out_shape]`
    (a q projection `[embed] -> [heads, head_dim]` gets A `[embed, rank]`, B `[rank, heads,
    head_dim]`). B starts at zero, so a new adapter leaves the model unchanged. A starts fan-in
    normal (std 1/sqrt(fan_in)), as `Linear` does; PEFT's kaiming-uniform A (std
    1/sqrt(3 fan_in)) differs only in scale, which training with B = 0 at the start does not need
    to match. The adapter's arrays are stored in `dtype` (float32 by default: they are the trained
    weights) and the update is computed in the call's dtype.

    Dropout (rate `dropout`) applies to the adapter's input only, and only when a `key` is passed
    to the call; without one the layer is deterministic (evaluation, and the model's forward,
    which passes none).
    """

    base: Linear | QuantizedLinear
    lora_a: Float[Array, "..."]
    lora_b: Float[Array, "..."]
    rank: int = eqx.field(static=True)
    alpha: float = eqx.field(static=True)
    dropout: float = eqx.field(static=True)

    def __init__(
        self,
        base: Linear | QuantizedLinear,
        *,
        rank: int,
        alpha: float | int,
        dropout: float = 0.0,
        dtype: DTypeLike = jnp.float32,
        key: PRNGKeyArray,
    ):
        # Checked here, where every adapter is made (add_lora, load_adapter, train.py): a rank of
        # 4.9 would become 4 and an alpha of NaN would turn every output into NaN.
        if isinstance(rank, bool) or not isinstance(rank, int | np.integer) or rank < 1:
            raise ValueError(f"LoRA rank must be an integer >= 1, got {rank!r}")
        for name, value in (("alpha", alpha), ("dropout", dropout)):
            if isinstance(value, bool) or not isinstance(value, int | float | np.number):
                raise TypeError(f"LoRA {name} must be a number, got {value!r}")
            if not math.isfinite(value):
                raise ValueError(f"LoRA {name} must be finite, got {value!r}")
        if not 0.0 <= dropout < 1.0:
            raise ValueError(f"LoRA dropout must be in [0, 1), got {dropout}")
        rank = int(rank)
        self.base, self.rank, self.alpha, self.dropout = base, rank, float(alpha), float(dropout)
        std = 1.0 / math.sqrt(math.prod(base.in_shape))
        self.lora_a = scaled_normal(key, std, (*base.in_shape, rank), dtype)
        self.lora_b = jnp.zeros((rank, *base.out_shape), dtype)

    @property
    def scale(self) -> float:
        return self.alpha / self.rank

    def __call__(
        self,
        x: Float[Array, "..."],
        *,
        dtype: DTypeLike | None = None,
        key: PRNGKeyArray | None = None,
    ) -> Float[Array, "..."]:
        """x: `[*batch, *in_shape]` -> `[*batch, *out_shape]`, computed in `dtype` (default
        x's). `key` turns dropout on."""
        dtype = dtype or x.dtype
        y = self.base(x, dtype=dtype)
        h = x.astype(dtype)
        if key is not None and self.dropout > 0.0:
            keep = jax.random.bernoulli(key, 1.0 - self.dropout, h.shape)
            h = jnp.where(keep, h / (1.0 - self.dropout), 0.0).astype(dtype)
        n_in, n_out = len(self.in_shape), len(self.out_shape)
        letters = string.ascii_letters
        contract, out, r = letters[:n_in], letters[n_in : n_in + n_out], letters[-1]
        down = jnp.einsum(f"...{contract},{contract}{r}->...{r}", h, self.lora_a.astype(dtype))
        # The scale goes on the rank-wide intermediate: rank multiplies instead of out_shape's.
        down = down * jnp.asarray(self.scale, dtype)
        up = jnp.einsum(f"...{r},{r}{out}->...{out}", down, self.lora_b.astype(dtype))
        return y + up

    def delta(self) -> Float[Array, "..."]:
        """scale · A · B, shaped like the base weight `[*in_shape, *out_shape]` (float32)."""
        a = self.lora_a.astype(jnp.float32).reshape(-1, self.rank)
        b = self.lora_b.astype(jnp.float32).reshape(self.rank, -1)
        return (self.scale * (a @ b)).reshape(*self.in_shape, *self.out_shape)

    def merged(self) -> Linear:
        """The base Linear with the update folded in, W + scale · A · B (in W's dtype): the same
        function up to float rounding, with no adapter left."""
        if not isinstance(self.base, Linear):
            raise TypeError(
                f"merging a LoRA needs a Linear base to fold the update into, not a "
                f"{type(self.base).__name__}: its packed weight cannot hold the update; merge "
                "into the float model (zoo.dequantize(model), then merge_adapter), or keep the "
                "adapter apart"
            )
        weight = self.base.weight
        merged = (weight.astype(jnp.float32) + self.delta()).astype(weight.dtype)
        return eqx.tree_at(lambda linear: linear.weight, self.base, merged)

    def logical_axes(self) -> dict[str, tuple[str, ...]]:
        n_in = len(self.in_shape)
        return {
            "lora_a": (*self.axes[:n_in], "lora_rank"),
            "lora_b": ("lora_rank", *self.axes[n_in:]),
        }
