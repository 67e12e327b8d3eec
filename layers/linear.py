"""A dense projection written as one einsum over named input and output dimensions."""

import math
import string

import equinox as eqx
import jax.numpy as jnp
from jax.typing import DTypeLike
from jaxtyping import Array, Float, Int, PRNGKeyArray

from layers.init import scaled_normal
from layers.kernels.cpu.dense import dense_product, uses_dense_kernel


class Linear(eqx.Module):
    """y = x · W (+ b), contracting the trailing `in_shape` dims of x with the leading dims of W.

    `in_shape`/`out_shape` may have several dims, so an attention projection is one Linear:
    `Linear((d_model,), (n_heads, head_dim), axes=("embed", "heads", "head_dim"))` maps
    `[batch, seq, embed] -> [batch, seq, heads, head_dim]` (einsum "bsa,abc->bsbc" style).

    Weights use fan-in normal init (std = 1/sqrt(fan_in)) unless `init_std` is given.

    `layer`: None, or, inside a stacked model's layer loop, the layer this projection is: its
    weight is then the whole stack `[layers, *in_shape, *out_shape]` (bias sliced) and the CPU
    kernel reads `weight[layer]` where it lies, since a slice fed to a product is a copy of the
    weight every step (`at_layer`; XLA's einsum path takes the slice).
    """

    weight: Float[Array, "..."]
    bias: Float[Array, "..."] | None
    in_shape: tuple[int, ...] = eqx.field(static=True)
    out_shape: tuple[int, ...] = eqx.field(static=True)
    axes: tuple[str, ...] = eqx.field(static=True)
    layer: Int[Array, ""] | None = None

    def __init__(
        self,
        in_shape: int | tuple[int, ...],
        out_shape: int | tuple[int, ...],
        *,
        axes: tuple[str, ...],
        use_bias: bool = False,
        init_std: float | None = None,
        dtype: DTypeLike = jnp.float32,
        key: PRNGKeyArray,
    ):
        self.in_shape = (in_shape,) if isinstance(in_shape, int) else tuple(in_shape)
        self.out_shape = (out_shape,) if isinstance(out_shape, int) else tuple(out_shape)
        if len(axes) != len(self.in_shape) + len(self.out_shape):
            raise ValueError(
                f"Linear axes {axes} must name every weight dim {self.in_shape + self.out_shape}"
            )
        self.axes = tuple(axes)
        std = init_std if init_std is not None else 1.0 / math.sqrt(math.prod(self.in_shape))
        shape = self.in_shape + self.out_shape
        self.weight = scaled_normal(key, std, shape, dtype)
        self.bias = jnp.zeros(self.out_shape, dtype) if use_bias else None

    @staticmethod
    def of(
        weight: Array,
        bias: Array | None,
        *,
        n_in: int,
        axes: tuple[str, ...],
        layer: Int[Array, ""] | None = None,
    ) -> "Linear":
        """A Linear holding these arrays (no initialisation): `weight` is `[*layers, *in_shape,
        *out_shape]` with `n_in` input dims and len(axes) dims after any leading layer dims."""
        shape = weight.shape[weight.ndim - len(axes) :]
        linear = object.__new__(Linear)
        for name, value in [("weight", weight), ("bias", bias), ("in_shape", shape[:n_in]),
                            ("out_shape", shape[n_in:]), ("axes", tuple(axes)),
                            ("layer", layer)]:  # fmt: skip
            object.__setattr__(linear, name, value)
        return linear

    def at_layer(self, layer: Int[Array, ""]) -> "Linear":
        """This stacked projection (`[layers, ...]` arrays) as layer `layer`: the weight kept
        whole and read at `layer` by the call, the bias sliced."""
        bias = None if self.bias is None else self.bias[layer]
        return Linear.of(self.weight, bias, n_in=len(self.in_shape), axes=self.axes, layer=layer)

    def layer_weight(self) -> Float[Array, "*in_and_out"]:
        """The weight `[*in_shape, *out_shape]` this projection multiplies by (a slice of the
        stack, a copy, when it reads a layer)."""
        return self.weight if self.layer is None else self.weight[self.layer]

    def __call__(
        self, x: Float[Array, "..."], *, dtype: DTypeLike | None = None
    ) -> Float[Array, "..."]:
        """x: `[*batch, *in_shape]` -> `[*batch, *out_shape]`, computed in `dtype` (default x's).
        A few float32 tokens on a CPU (a decode step) take the CPU kernel of
        `layers.kernels.cpu.dense`, everything else one XLA einsum."""
        dtype = dtype or x.dtype
        n_in, n_out = len(self.in_shape), len(self.out_shape)
        batch = x.shape[: x.ndim - n_in]
        if uses_dense_kernel(math.prod(batch), x.dtype, self.weight.dtype, dtype):
            k, n = math.prod(self.in_shape), math.prod(self.out_shape)
            stack = () if self.layer is None else (-1,)
            w = self.weight.reshape(*stack, k, n)
            flat = dense_product(x.reshape(-1, k), w, False, self.layer)
            y = flat.reshape(*batch, *self.out_shape)
            return y if self.bias is None else y + self.bias
        letters = string.ascii_letters
        contract, out = letters[:n_in], letters[n_in : n_in + n_out]
        spec = f"...{contract},{contract}{out}->...{out}"
        y = jnp.einsum(spec, x.astype(dtype), self.layer_weight().astype(dtype))
        if self.bias is not None:
            y = y + self.bias.astype(dtype)
        return y

    def logical_axes(self) -> dict[str, tuple[str, ...]]:
        names = {"weight": self.axes}
        if self.bias is not None:
            names["bias"] = self.axes[len(self.in_shape) :]
        return names
