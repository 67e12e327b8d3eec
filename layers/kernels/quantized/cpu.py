"""The packed-weight CPU kernel (layers/kernels/cpu/matmul.cc) through `jax.ffi`:
`cpu_matmul(x, weight)` is `x · W^T` for a `PackedWeight`, dequantizing in registers,
optionally per expert (`group_sizes`);
`cpu_dequantize(weight)` is `weight.dequantize()` (bit for bit) as one call, for the many-token
path (one XLA dot after it) without an XLA fusion to compile per weight.

With `int8_activations` (what `weight.activations == "int8"` asks for) the kernel first rounds x
per 32 inputs to int8 codes and a float32 step (`quantize_activations`, llama.cpp's Q8_0
activations) and computes `x̂ · W^T` with x̂ the rounded x: on a CPU with AVX-512 VNNI the codes
then multiply in integers (exact int32 sums, one scale per 32-input chunk), several times fewer
instructions than turning every weight into a float; with weights in groups of 32 (GGUF's Q4_0,
Q4_1, Q4_K, Q8_0) sixteen rows a vector, faster than the float walk at every token count
measured (bench/RESULTS.md, "Int8 activations sixteen rows a vector"). `default_activations()`
is what a GGUF model loads with: "int8" on such a CPU, else "float".

The library (layers/kernels/cpu) is loaded on first use; a missing or stale one is an error that
says how to build it.
"""

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, Int

from layers.kernels.cpu import DEQUANTIZE_TARGET, QUANTIZED_TARGET, ensure_built, integer_products
from layers.quantized.formats import Activations, PackedWeight


def integer_rows(weight: PackedWeight) -> bool:
    """Whether the kernel multiplies `weight` sixteen rows a vector in integers (matmul.cc's
    `lanes_take`): int8 activations on a CPU with AVX-512 VNNI, and integer levels (int8, 4-bit
    `code + offset`, Q4_K) in groups of 32."""
    if weight.activations != "int8" or weight.group != 32 or not integer_products():
        return False
    linear = weight.kernel_format == "u4" and weight.kernel_attrs()["linear"]
    return linear or weight.kernel_format in ("i8", "q4k")


def default_activations() -> Activations:
    """The activations packed weights loaded for decode take by default: "int8" where this
    process computes on a CPU whose kernel multiplies codes in integers (AVX-512 VNNI), the
    faster path there; else "float" (a GPU's kernel, and a CPU without VNNI, take x as it is)."""
    return "int8" if jax.default_backend() == "cpu" and integer_products() else "float"


def quantize_activations(x: Float[Array, "tokens cols"]) -> Float[Array, "tokens cols"]:
    """x̂: x rounded per 32 consecutive inputs to int8 codes times a float32 step, as the kernel
    does with `int8_activations` (the specification it is tested against): d = max|x| / 127,
    q = round-half-even(x · (1 / d)) clipped to [-127, 127] (0 where d == 0), x̂ = q d. Each
    x̂_i errs from x_i by at most d / 2 (+ float32 rounding of the product)."""
    chunks = x.astype(jnp.float32).reshape(*x.shape[:-1], -1, 32)
    d = jnp.max(jnp.abs(chunks), axis=-1, keepdims=True) / 127
    inverse = jnp.where(d != 0, 1 / jnp.where(d != 0, d, 1), 0)
    q = jnp.clip(jnp.round(chunks * inverse), -127, 127)
    return (q * d).reshape(x.shape)


def cpu_matmul(
    x: Float[Array, "tokens cols"],
    weight: PackedWeight,
    group_sizes: Int[Array, " experts"] | None = None,
    *,
    int8_activations: bool = False,
    portable: bool = False,
    layer: Int[Array, ""] | None = None,
) -> Float[Array, "tokens rows"]:
    """`x · W^T` (float32) for `weight` `[rows, cols]`, or with `group_sizes` for an expert-stacked
    `[experts, rows, cols]` weight: rows of x sorted by expert, `group_sizes[e]` of them for
    expert e (rows past their sum give zeros), or with `layer` for a layer-stacked `[layers,
    rows, cols]` weight, read at `layer` where it lies (a stacked model's layer loop: slicing
    it first would copy it every step). `int8_activations`: `quantize_activations(x) · W^T`
    instead (the module docstring). `portable` runs the kernel's plain C++ path instead of its
    AVX-512 (or, without AVX-512, AVX2) ones (a test of both)."""
    stacks = (group_sizes is not None) + (layer is not None)
    if len(weight.lead) != stacks or stacks > 1:
        raise ValueError(
            f"cpu_matmul takes a weight [rows, cols], or one stacked [experts or layers, rows, "
            f"cols] with group_sizes or a layer; got leading dims {weight.lead} with "
            f"{'group_sizes' if group_sizes is not None else 'no group_sizes'} and "
            f"{'a layer' if layer is not None else 'no layer'}"
        )
    ensure_built()
    rows, _ = weight.shape
    experts = 0 if group_sizes is None else weight.lead[-1]
    layers = 0 if layer is None else weight.lead[-1]
    extra = () if group_sizes is None else (group_sizes.astype(jnp.int32),)
    extra += () if layer is None else (jnp.asarray(layer, jnp.int32),)
    call = jax.ffi.ffi_call(
        QUANTIZED_TARGET,
        jax.ShapeDtypeStruct((x.shape[0], rows), jnp.float32),
        vmap_method="sequential",
    )
    attrs = weight.kernel_attrs()
    return call(
        x.astype(jnp.float32),
        *weight.kernel_arrays(),
        *extra,
        format=weight.kernel_format,
        group=np.int64(weight.group),
        experts=np.int64(experts),
        layers=np.int64(layers),
        linear=bool(attrs["linear"]),
        offset=np.float32(attrs["offset"]),
        int8=int8_activations,
        portable=portable,
    )


def cpu_dequantize(
    weight: PackedWeight, *, portable: bool = False
) -> Float[Array, "... rows cols"]:
    """`weight.dequantize(jnp.float32)`, equal bit for bit, `[*lead, rows, cols]`, computed by
    the library (threaded over rows, AVX-512 where the CPU has it, else AVX2 but for a 4-bit
    table; `portable`: its plain C++ path). Under vmap the batch becomes one more leading dim
    (the kernel takes any)."""
    ensure_built()
    attrs = weight.kernel_attrs()
    call = jax.ffi.ffi_call(
        DEQUANTIZE_TARGET,
        jax.ShapeDtypeStruct((*weight.lead, *weight.shape), jnp.float32),
        vmap_method="broadcast_all",
    )
    return call(
        *weight.kernel_arrays(),
        format=weight.kernel_format,
        group=np.int64(weight.group),
        linear=bool(attrs["linear"]),
        offset=np.float32(attrs["offset"]),
        portable=portable,
    )
