"""Matrix products with weights held packed (layers/quantized/formats.py), dequantized inside the
kernel: `quantized_matmul(x, weight)` and, per expert, `quantized_ragged_matmul(x, weight,
group_sizes)`, dispatched per backend (ops.py): the jax.ffi CPU kernel (cpu.py, built from
layers/kernels/cpu/matmul.cc; `cpu_dequantize` its float copy of a weight for many tokens), the
Pallas GPU kernel (pallas.py), or dequantize + XLA matmul (the specification)."""

from layers.kernels.quantized.cpu import (
    cpu_dequantize,
    cpu_matmul,
    default_activations,
    integer_rows,
    quantize_activations,
)
from layers.kernels.quantized.ops import (
    KERNEL_TOKENS,
    kernel_tokens,
    quantized_matmul,
    quantized_ragged_matmul,
    reference_matmul,
    reference_ragged_matmul,
)

__all__ = [
    "KERNEL_TOKENS",
    "cpu_dequantize",
    "cpu_matmul",
    "default_activations",
    "integer_rows",
    "kernel_tokens",
    "quantize_activations",
    "quantized_matmul",
    "quantized_ragged_matmul",
    "reference_matmul",
    "reference_ragged_matmul",
]
