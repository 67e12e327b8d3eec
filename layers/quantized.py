"""A frozen projection stored in 8 or 4 bits: the quantized base of QLoRA (Dettmers et al. 2023).

`QuantizedLinear` has `Linear`'s call interface (`__call__(x, dtype=)`, `in_shape`, `out_shape`,
`axes`), so a LoRA adapter can wrap it as it wraps a `Linear`. Two storage kinds:

- `"int8"`: absmax symmetric per output channel (LLM.int8's vector-wise quantization without
  its outlier split, Dettmers et al. 2022): `scale[o] = max_i |W[i, o]| / 127`,
  `code = round(W / scale)` in [-127, 127]. Dequantization error per weight <= scale[o] / 2.
- `"nf4"`: 4-bit NormalFloat (QLoRA, section 3): each block of `block` consecutive weights along
  the last input dim is divided by its absmax and rounded to the nearest of the 16 NF4 levels
  (`NF4_LEVELS`); two 4-bit codes are packed per uint8 (element 2j in the low nibble, 2j + 1 in
  the high one). Error per weight <= `NF4_MAX_HALF_GAP` x the block's absmax. QLoRA's double
  quantization of the scales is not done: they stay float32.

Scales are float32 whatever the weight's dtype: a bfloat16 scale would add its own 2^-8 relative
error to every weight it scales. The bias, if any, is kept as it was (float).

The forward dequantizes to the compute dtype inside the call and runs the same contraction as
`Linear`. Memory is the win (1 or 1/2 byte per weight instead of 2 or 4), not speed: under jit
XLA fuses the dequantization into the matmul's operand on GPU, but on this CPU it does not fuse an
int8 convert into a matrix-vector product (see DESIGN.md), and it never makes the matmul cheaper.

The whole module is a frozen base: its codes are integers, which no optimizer sees, and
`training.step.split_model` also leaves its float scales and bias out (a zero gradient alone
would not freeze them: AdamW's decoupled weight decay still moves every leaf it is given).
"""

from typing import Literal

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jax.typing import DTypeLike
from jaxtyping import Array, Float, Integer

from layers.linear import Linear

Kind = Literal["int8", "nf4"]
KINDS: tuple[str, ...] = ("int8", "nf4")

# The 16 NF4 levels (QLoRA appendix E; bitsandbytes' `create_normal_map`): quantiles of N(0, 1)
# rescaled to [-1, 1], with an exact zero.
NF4_LEVELS = np.array(
    [
        -1.0,
        -0.6961928009986877,
        -0.5250730514526367,
        -0.39491748809814453,
        -0.28444138169288635,
        -0.18477343022823334,
        -0.09105003625154495,
        0.0,
        0.07958029955625534,
        0.16093020141124725,
        0.24611230194568634,
        0.33791524171829224,
        0.44070982933044434,
        0.5626170039176941,
        0.7229568362236023,
        1.0,
    ],
    dtype=np.float32,
)
# Rounding to the nearest level errs by at most half the widest gap (between -1 and the next).
NF4_MAX_HALF_GAP = float(np.max(np.diff(NF4_LEVELS)) / 2)
NF4_MIDPOINTS = (NF4_LEVELS[1:] + NF4_LEVELS[:-1]) / 2
INT8_MAX = 127


def check_kind(kind: str, block: int, in_shape: tuple[int, ...]) -> None:
    """Clear errors for a storage kind or NF4 block size that cannot quantize `in_shape`."""
    if kind not in KINDS:
        raise ValueError(f"quantization kind {kind!r} is not one of {KINDS}")
    if kind == "nf4" and (block < 2 or block % 2 or in_shape[-1] % block):
        raise ValueError(
            f"nf4 block {block} must be even and divide the last input dim {in_shape[-1]} "
            f"(in_shape {in_shape}): blocks run along it and pack two 4-bit codes per byte"
        )


class QuantizedLinear(eqx.Module):
    """y = x · dequantize(codes, scales) (+ b), contracting x's trailing `in_shape` dims.

    Shapes, with `in_shape = (*lead, n)` and `out_shape`:
    - int8: `codes` int8 `[*lead, n, *out_shape]` (W's shape), `scales` `[*out_shape]`;
    - nf4: `codes` uint8 `[*lead, n / 2, *out_shape]`, `scales` `[*lead, n / block, *out_shape]`.
    Both carry W's logical axes (`logical_axes()`), so they shard like the float weight; the
    packed and blocked dims of nf4 divide by a mesh axis only when `n / block` does, and
    `shard.param_shardings` names the array that does not.
    """

    codes: Integer[Array, "..."]
    scales: Float[Array, "..."]
    bias: Float[Array, "..."] | None
    in_shape: tuple[int, ...] = eqx.field(static=True)
    out_shape: tuple[int, ...] = eqx.field(static=True)
    axes: tuple[str, ...] = eqx.field(static=True)
    kind: Kind = eqx.field(static=True)
    block: int | None = eqx.field(static=True)

    def __check_init__(self):
        check_kind(self.kind, self.block or 0, self.in_shape)

    @staticmethod
    def from_linear(linear: Linear, kind: Kind, *, block: int = 64) -> "QuantizedLinear":
        """`linear`'s weight quantized as `kind` ("int8" or "nf4"; `block` is NF4's block length
        along the last input dim and is ignored by int8). For a stacked Linear (leading layer
        dims on its arrays), each layer is quantized with its own scales (vmapped)."""
        check_kind(kind, block, linear.in_shape)
        stacked = linear.weight.ndim - len(linear.in_shape) - len(linear.out_shape)
        quantize = lambda lin: _quantize(lin, kind, block)  # noqa: E731
        for _ in range(stacked):
            quantize = eqx.filter_vmap(quantize)
        return quantize(linear)

    def weight(self, dtype: DTypeLike = jnp.float32) -> Float[Array, "..."]:
        """The dequantized weight `[*in_shape, *out_shape]` in `dtype` (computed in float32), of
        one layer (a stacked module's `dequantize()` vmaps over its layers)."""
        n_in = len(self.in_shape)
        if self.kind == "int8":
            return (self.codes.astype(jnp.float32) * self.scales).astype(dtype)
        lead, out = self.codes.shape[: n_in - 1], self.codes.shape[n_in:]
        low, high = self.codes & 0xF, self.codes >> 4
        # [..., n/2, 2, *out] -> [..., n, *out]: element 2j low nibble, 2j + 1 high.
        index = jnp.stack([low, high], axis=n_in).reshape(*lead, -1, *out)
        values = jnp.asarray(NF4_LEVELS)[index.astype(jnp.int32)]
        blocks = values.reshape(*lead, -1, self.block, *out)
        w = blocks * jnp.expand_dims(self.scales, n_in)
        return w.reshape(*self.in_shape, *out).astype(dtype)

    def __call__(
        self, x: Float[Array, "..."], *, dtype: DTypeLike | None = None
    ) -> Float[Array, "..."]:
        """x: `[*batch, *in_shape]` -> `[*batch, *out_shape]`, computed in `dtype` (default x's)."""
        dtype = dtype or x.dtype
        n_in = len(self.in_shape)
        contract = (tuple(range(x.ndim - n_in, x.ndim)), tuple(range(n_in)))
        # Rematerialised: the backward dequantizes again instead of keeping the float weight as
        # a residual, which would hold a float copy of the whole base through a train step.
        project = jax.checkpoint(lambda q, x: jnp.tensordot(x, q.weight(dtype), axes=contract))
        y = project(self, x.astype(dtype))
        if self.bias is not None:
            y = y + self.bias.astype(dtype)
        return y

    def dequantize(self, dtype: DTypeLike = jnp.float32) -> Linear:
        """A float `Linear` holding the dequantized weight in `dtype` (and the bias as it is);
        stacked modules stay stacked."""
        stacked = self.codes.ndim - len(self.in_shape) - len(self.out_shape)
        to_linear = lambda q: q._to_linear(dtype)  # noqa: E731
        for _ in range(stacked):
            to_linear = eqx.filter_vmap(to_linear)
        return to_linear(self)

    def _to_linear(self, dtype: DTypeLike) -> Linear:
        template = eqx.filter_eval_shape(
            lambda: Linear(
                self.in_shape,
                self.out_shape,
                axes=self.axes,
                use_bias=self.bias is not None,
                dtype=dtype,
                key=jax.random.key(0),
            )
        )
        return eqx.tree_at(
            lambda lin: (lin.weight, lin.bias),
            template,
            (self.weight(dtype), self.bias),
            is_leaf=lambda leaf: leaf is None,
        )

    def logical_axes(self) -> dict[str, tuple[str, ...]]:
        out_axes = self.axes[len(self.in_shape) :]
        names = {
            "codes": self.axes,
            "scales": out_axes if self.kind == "int8" else self.axes,
        }
        if self.bias is not None:
            names["bias"] = out_axes
        return names


def _quantize(linear: Linear, kind: Kind, block: int) -> QuantizedLinear:
    """One (unstacked) Linear's weight as codes and scales."""
    n_in = len(linear.in_shape)
    w = linear.weight.astype(jnp.float32)
    if kind == "int8":
        absmax = jnp.max(jnp.abs(w), axis=tuple(range(n_in)))
        scales = absmax / INT8_MAX
        # An all-zero channel: any divisor gives code 0, and scale 0 dequantizes it exactly.
        safe = jnp.where(scales > 0, scales, 1.0)
        codes = jnp.clip(jnp.round(w / safe), -INT8_MAX, INT8_MAX).astype(jnp.int8)
        return _build(linear, codes, scales, kind, None)
    lead, n, out = linear.in_shape[:-1], linear.in_shape[-1], linear.out_shape
    blocks = w.reshape(*lead, n // block, block, *out)
    scales = jnp.max(jnp.abs(blocks), axis=n_in)
    safe = jnp.expand_dims(jnp.where(scales > 0, scales, 1.0), n_in)
    normalized = (blocks / safe).reshape(w.shape)
    # The nearest level, by the midpoints between levels: no [*W, 16] distance table (a 7B
    # model's stacked MLP weight would need tens of GB for it).
    index = jnp.searchsorted(jnp.asarray(NF4_MIDPOINTS), normalized).astype(jnp.uint8)
    pairs = index.reshape(*lead, n // 2, 2, *out)
    low, high = jnp.take(pairs, 0, axis=n_in), jnp.take(pairs, 1, axis=n_in)
    return _build(linear, low | (high << 4), scales, kind, block)


def _build(linear: Linear, codes, scales, kind: Kind, block: int | None) -> QuantizedLinear:
    return QuantizedLinear(
        codes=codes,
        scales=scales,
        bias=linear.bias,
        in_shape=linear.in_shape,
        out_shape=linear.out_shape,
        axes=linear.axes,
        kind=kind,
        block=block,
    )
