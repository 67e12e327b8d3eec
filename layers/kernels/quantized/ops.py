"""`x · W^T` for a packed weight, dispatched per backend when the program is lowered:

- CPU: the jax.ffi kernel (cpu.py) for up to `KERNEL_TOKENS` tokens (decode, small batches):
  each weight is read once, packed, and dequantized in registers; with the weight's
  `activations == "int8"` (the default) it computes `quantize_activations(x) · W^T`;
- GPU (cuda): the Pallas kernel (pallas.py) for up to `KERNEL_TOKENS` tokens, for the formats it
  implements (`pallas.SUPPORTED`);
- otherwise (more tokens: prefill and training; other backends or formats): dequantize to the
  compute dtype and one XLA matmul (the specification the kernels are tested against).

The token count is a static shape, so the choice is made once per compiled program. Gradients
flow to x only (a packed weight is frozen: its cotangent is zero) through a custom VJP whose
backward dequantizes again instead of keeping a float copy of W as a residual.
"""

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, Int

from layers.kernels.quantized import pallas
from layers.kernels.quantized.cpu import cpu_matmul
from layers.quantized.formats import PackedWeight

# Up to this many tokens (rows of x) a kernel runs; beyond it, dequantize + XLA matmul
# (bench/quantized_kernels.py measures the crossover on this CPU).
KERNEL_TOKENS = 32


def reference_matmul(
    x: Float[Array, "tokens cols"], weight: PackedWeight
) -> Float[Array, "tokens rows"]:
    """The specification: dequantize W to x's dtype, then `x · W^T`."""
    return x @ weight.dequantize(x.dtype).T


def reference_ragged_matmul(
    x: Float[Array, "tokens cols"], weight: PackedWeight, group_sizes: Int[Array, " experts"]
) -> Float[Array, "tokens rows"]:
    """The specification for expert-stacked weights: every expert dequantized, one ragged dot."""
    w = jnp.swapaxes(weight.dequantize(x.dtype), -1, -2)  # [experts, cols, rows]
    return jax.lax.ragged_dot(x, w, group_sizes)


def _zero_cotangent(leaf):
    if jnp.issubdtype(leaf.dtype, jnp.inexact):
        return jnp.zeros_like(leaf)
    return np.zeros(leaf.shape, jax.dtypes.float0)


def _frozen(weight: PackedWeight) -> PackedWeight:
    return jax.tree.map(_zero_cotangent, weight)


@jax.custom_vjp
def quantized_matmul(
    x: Float[Array, "tokens cols"], weight: PackedWeight
) -> Float[Array, "tokens rows"]:
    """`x · W^T` in x's dtype for `weight` `[rows, cols]` (see the module docstring)."""
    if x.shape[0] > KERNEL_TOKENS:
        return reference_matmul(x, weight)

    def cpu(x, weight):
        int8 = weight.activations == "int8"
        return cpu_matmul(x, weight, int8_activations=int8).astype(x.dtype)

    branches = {"cpu": cpu}
    if pallas.supports(weight):
        branches["cuda"] = pallas.pallas_matmul
    return jax.lax.platform_dependent(x, weight, default=reference_matmul, **branches)


def _matmul_fwd(x, weight):
    return quantized_matmul(x, weight), weight


def _matmul_bwd(weight, dy):
    return dy @ weight.dequantize(dy.dtype), _frozen(weight)


quantized_matmul.defvjp(_matmul_fwd, _matmul_bwd)


@jax.custom_vjp
def quantized_ragged_matmul(
    x: Float[Array, "tokens cols"], weight: PackedWeight, group_sizes: Int[Array, " experts"]
) -> Float[Array, "tokens rows"]:
    """Rows of x sorted by expert, `group_sizes[e]` of them for expert e of the expert-stacked
    `weight` `[experts, rows, cols]`: each row times its own expert's W^T (`jax.lax.ragged_dot`'s
    contract). The CPU kernel reads only the experts that have rows."""
    if x.shape[0] > KERNEL_TOKENS:
        return reference_ragged_matmul(x, weight, group_sizes)

    def cpu(x, weight, group_sizes):
        int8 = weight.activations == "int8"
        return cpu_matmul(x, weight, group_sizes, int8_activations=int8).astype(x.dtype)

    return jax.lax.platform_dependent(
        x, weight, group_sizes, default=reference_ragged_matmul, cpu=cpu
    )


def _ragged_fwd(x, weight, group_sizes):
    return quantized_ragged_matmul(x, weight, group_sizes), (weight, group_sizes)


def _ragged_bwd(residuals, dy):
    weight, group_sizes = residuals
    dx = jax.lax.ragged_dot(dy, weight.dequantize(dy.dtype), group_sizes)
    return dx, _frozen(weight), np.zeros(group_sizes.shape, jax.dtypes.float0)


quantized_ragged_matmul.defvjp(_ragged_fwd, _ragged_bwd)
