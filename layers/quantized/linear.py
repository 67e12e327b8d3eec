"""A projection whose weight is held packed (formats.py): `QuantizedLinear` has `Linear`'s call
interface (`__call__(x, dtype=)`, `in_shape`, `out_shape`, `axes`), so a model runs it unchanged
and a LoRA adapter wraps it as it wraps a `Linear` (QLoRA's frozen base, Dettmers et al. 2023).

The weight is `W^T` as a packed `[rows, cols]` matrix: rows the flattened `out_shape`, cols the
flattened `in_shape` (a Linear's weight is `[*in_shape, *out_shape]`: this is its transpose,
rows contiguous as llama.cpp stores them). The forward flattens x to `[tokens, cols]` and calls
`layers.kernels.quantized.quantized_matmul` (the CPU kernel, the Pallas kernel or dequantize +
XLA matmul, by backend and token count); the bias, if any, stays float.

The module is a frozen base: its codes are integers, which no optimizer sees, and
`training.step.split_model` also leaves its float scales and bias out (a zero gradient alone
would not freeze them: AdamW's decoupled weight decay still moves every leaf it is given).
"""

import math

import equinox as eqx
import jax.numpy as jnp
from jax.typing import DTypeLike
from jaxtyping import Array, Float, Int

from layers.kernels.quantized import quantized_matmul
from layers.linear import Linear
from layers.quantized.formats import PackedWeight
from layers.quantized.quantize import Kind, pack


class QuantizedLinear(eqx.Module):
    """y = x · dequantize(packed)^T (+ b), contracting x's trailing `in_shape` dims."""

    packed: PackedWeight
    bias: Float[Array, "..."] | None
    in_shape: tuple[int, ...] = eqx.field(static=True)
    out_shape: tuple[int, ...] = eqx.field(static=True)
    axes: tuple[str, ...] = eqx.field(static=True)
    layer: Int[Array, ""] | None = None  # as `Linear.layer`: the packed stack read at `layer`

    @property
    def kind(self) -> str:
        """The format's name: int8, int4, nf4, q8_0, q4_0, q4_1, q4_k or q6_k."""
        return self.packed.name

    @staticmethod
    def from_linear(linear: Linear, kind: Kind, *, group: int | None = None) -> "QuantizedLinear":
        """`linear`'s weight quantized as `kind` ("int8", "int4", "nf4"; `group` weights per
        scale along the flattened input, default per kind: layers/quantized/quantize.py). A
        stacked Linear (leading layer dims on its arrays) keeps them: each layer gets its own
        scales."""
        n_in, n_out = len(linear.in_shape), len(linear.out_shape)
        lead = linear.weight.shape[: linear.weight.ndim - n_in - n_out]  # stacked layers
        cols, rows = math.prod(linear.in_shape), math.prod(linear.out_shape)
        # [*lead, *in, *out] -> [*lead, rows, cols]
        w = jnp.swapaxes(linear.weight.reshape(*lead, cols, rows), -1, -2)
        # Rows named by the first output dim, cols by the first input dim (a flattened
        # heads x head_dim splits over devices as its heads would).
        axes = (linear.axes[n_in], linear.axes[0])
        what = f"Linear {linear.in_shape} -> {linear.out_shape}"
        packed = pack(w, kind, group=group, axes=axes, what=what)
        return QuantizedLinear.of(
            packed, linear.bias, linear.in_shape, linear.out_shape, linear.axes
        )

    @staticmethod
    def of(
        packed: PackedWeight,
        bias: Array | None,
        in_shape: tuple[int, ...],
        out_shape: tuple[int, ...],
        axes: tuple[str, ...],
    ) -> "QuantizedLinear":
        """A QuantizedLinear holding `packed` (`[*layers, prod(out_shape), prod(in_shape)]`)."""
        rows, cols = packed.shape
        if (rows, cols) != (math.prod(out_shape), math.prod(in_shape)):
            raise ValueError(
                f"a packed {packed.name} weight of {rows} rows x {cols} inputs cannot be a "
                f"projection {in_shape} -> {out_shape}"
            )
        return QuantizedLinear(packed, bias, tuple(in_shape), tuple(out_shape), tuple(axes))

    def at_layer(self, layer: Int[Array, ""]) -> "QuantizedLinear":
        """This stacked projection as layer `layer`, as `Linear.at_layer`: the packed weight
        kept whole and read at `layer` by the call, the bias sliced."""
        bias = None if self.bias is None else self.bias[layer]
        return QuantizedLinear(self.packed, bias, self.in_shape, self.out_shape, self.axes, layer)

    def weight(self, dtype: DTypeLike = jnp.float32) -> Float[Array, "..."]:
        """The dequantized weight `[*layers, *in_shape, *out_shape]` in `dtype` (computed in
        float32): what `Linear.weight` would hold."""
        w = jnp.swapaxes(self.packed.dequantize(dtype), -1, -2)  # [*layers, cols, rows]
        return w.reshape(*w.shape[:-2], *self.in_shape, *self.out_shape)

    def __call__(
        self, x: Float[Array, "..."], *, dtype: DTypeLike | None = None
    ) -> Float[Array, "..."]:
        """x: `[*batch, *in_shape]` -> `[*batch, *out_shape]`, computed in `dtype` (default x's)."""
        dtype = dtype or x.dtype
        batch = x.shape[: x.ndim - len(self.in_shape)]
        flat = x.astype(dtype).reshape(-1, self.packed.cols)
        y = quantized_matmul(flat, self.packed, self.layer).reshape(*batch, *self.out_shape)
        if self.bias is not None:
            y = y + self.bias.astype(dtype)
        return y

    def dequantize(self, dtype: DTypeLike = jnp.float32) -> Linear:
        """The float `Linear` this stands for, its weight dequantized to `dtype` (the bias as it
        is); stacked modules stay stacked."""
        return Linear.of(self.weight(dtype), self.bias, n_in=len(self.in_shape), axes=self.axes)

    def logical_axes(self) -> dict[str, tuple[str, ...]]:
        return {} if self.bias is None else {"bias": self.axes[len(self.in_shape) :]}
