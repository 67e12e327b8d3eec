"""`x · W^T` for a packed weight, dispatched by the backend the program is traced for
(`jax.default_backend()`: the one jit compiles for unless told otherwise; a program lowered for
another platform, as `lower(lowering_platforms=...)` can, needs the default backend set to it,
e.g. by JAX_PLATFORMS):

- CPU: the jax.ffi kernel (cpu.py) for up to `kernel_tokens(weight)` tokens (decode, small
  batches, an engine step's prompt chunks): each weight is read once, packed, and dequantized
  in registers (with float activations and 16 tokens or more, 32 for groups of 32, a block of
  rows at a time into a buffer that serves every token); with the weight's `activations ==
  "int8"` it computes `quantize_activations(x) · W^T`, for groups of 32 on a CPU with AVX-512
  VNNI in integers at any token count. More tokens (prefill, training): the library's
  dequantize (`cpu_dequantize`, bit for bit the specification's float weight) and one XLA
  matmul;
- GPU: the Pallas kernel (pallas.py) for up to `PALLAS_TOKENS` tokens, for the formats it
  implements (`pallas.SUPPORTED`);
- otherwise (more tokens on a GPU; other backends or formats): dequantize to the compute dtype
  with XLA ops and one XLA matmul (the specification the kernels are tested against).

The backend and the token count are known when the program is traced, so one path is traced
per weight, once per compiled program (`jax.lax.platform_dependent` would trace every path of
every weight: ~0.9 s per engine program of SmolLM2's ~210 weights). Gradients flow to x only (a
packed weight is frozen: its cotangent is zero) through a custom VJP whose backward dequantizes
again instead of keeping a float copy of W as a residual.
"""

import math

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, Int

from layers.kernels.quantized import pallas
from layers.kernels.quantized.cpu import cpu_dequantize, cpu_matmul, integer_rows
from layers.quantized.formats import PackedWeight

# Up to this many tokens (rows of x) the CPU kernel runs; beyond it, dequantize + XLA matmul.
# Measured on SmolLM2's packed layers (bench/RESULTS.md, "Prompt chunks with packed weights"):
# the kernel is faster up to ~110 tokens with int8 activations and ~150 with float ones. The
# integer products sixteen rows a vector are faster at every count (`kernel_tokens`).
KERNEL_TOKENS = 96
# The same for the Pallas GPU kernel (bench/quantized_kernels.py measures the crossover).
PALLAS_TOKENS = 32


def kernel_tokens(weight: PackedWeight) -> int | float:
    """The most tokens the CPU kernel multiplies `weight` by: any number where it does so in
    integers sixteen rows a vector (`integer_rows`: about 2x dequantize + XLA's product from 96
    to 512 tokens; bench/RESULTS.md, "Int8 activations sixteen rows a vector"), so prefill
    rounds x as decode does; else `KERNEL_TOKENS`."""
    return math.inf if integer_rows(weight) else KERNEL_TOKENS


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


def dequantized(weight: PackedWeight, dtype) -> Float[Array, "... rows cols"]:
    """`weight.dequantize(dtype)`, the same values, by the CPU library's one call on a CPU (XLA
    compiles a fusion of bit operations per weight otherwise)."""
    if jax.default_backend() == "cpu":
        return cpu_dequantize(weight).astype(dtype)
    return weight.dequantize(dtype)


def _zero_cotangent(leaf):
    if jnp.issubdtype(leaf.dtype, jnp.inexact):
        return jnp.zeros_like(leaf)
    return np.zeros(leaf.shape, jax.dtypes.float0)


def _frozen(weight: PackedWeight) -> PackedWeight:
    return jax.tree.map(_zero_cotangent, weight)


def at_layer(weight: PackedWeight, layer: Int[Array, ""]) -> PackedWeight:
    """Layer `layer` of a layer-stacked weight `[layers, rows, cols]` (a copy of its arrays)."""
    return jax.tree.map(lambda a: a[layer], weight)


@jax.custom_vjp
def quantized_matmul(
    x: Float[Array, "tokens cols"], weight: PackedWeight, layer: Int[Array, ""] | None = None
) -> Float[Array, "tokens rows"]:
    """`x · W^T` in x's dtype for `weight` `[rows, cols]`, or with `layer` for a layer-stacked
    `[layers, rows, cols]` weight `W[layer]` (see the module docstring; the CPU kernel reads
    that layer where it lies, the other paths slice it first)."""
    backend = jax.default_backend()
    if backend == "cpu" and x.shape[0] <= kernel_tokens(weight):
        int8 = weight.activations == "int8"
        return cpu_matmul(x, weight, int8_activations=int8, layer=layer).astype(x.dtype)
    weight = weight if layer is None else at_layer(weight, layer)
    if backend == "gpu" and x.shape[0] <= PALLAS_TOKENS and pallas.supports(weight):
        return pallas.pallas_matmul(x, weight)
    return x @ dequantized(weight, x.dtype).T  # `reference_matmul`, by one call on a CPU


def _matmul_fwd(x, weight, layer):
    return quantized_matmul(x, weight, layer), (weight, layer)


def _matmul_bwd(residuals, dy):
    weight, layer = residuals
    taken = weight if layer is None else at_layer(weight, layer)
    no_layer = None if layer is None else np.zeros(layer.shape, jax.dtypes.float0)
    return dy @ dequantized(taken, dy.dtype), _frozen(weight), no_layer


quantized_matmul.defvjp(_matmul_fwd, _matmul_bwd)


@jax.custom_vjp
def quantized_ragged_matmul(
    x: Float[Array, "tokens cols"], weight: PackedWeight, group_sizes: Int[Array, " experts"]
) -> Float[Array, "tokens rows"]:
    """Rows of x sorted by expert, `group_sizes[e]` of them for expert e of the expert-stacked
    `weight` `[experts, rows, cols]`: each row times its own expert's W^T (`jax.lax.ragged_dot`'s
    contract). The CPU kernel reads only the experts that have rows."""
    if x.shape[0] > kernel_tokens(weight):
        w = jnp.swapaxes(dequantized(weight, x.dtype), -1, -2)  # [experts, cols, rows]
        return jax.lax.ragged_dot(x, w, group_sizes)
    if jax.default_backend() == "cpu":
        int8 = weight.activations == "int8"
        return cpu_matmul(x, weight, group_sizes, int8_activations=int8).astype(x.dtype)
    return reference_ragged_matmul(x, weight, group_sizes)


def _ragged_fwd(x, weight, group_sizes):
    return quantized_ragged_matmul(x, weight, group_sizes), (weight, group_sizes)


def _ragged_bwd(residuals, dy):
    weight, group_sizes = residuals
    dx = jax.lax.ragged_dot(dy, dequantized(weight, dy.dtype), group_sizes)
    return dx, _frozen(weight), np.zeros(group_sizes.shape, jax.dtypes.float0)


quantized_ragged_matmul.defvjp(_ragged_fwd, _ragged_bwd)
