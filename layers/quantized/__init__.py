"""Layers whose weights are held in packed blocks with their scales, read by kernels that
dequantize in registers (layers/kernels/quantized): `QuantizedLinear`, `QuantizedEmbedding`
(and the MoE's `layers.moe.QuantizedExperts`), over the typed packed weights of formats.py
(int8, int4, nf4 made by `pack`, and llama.cpp's Q8_0, Q4_0, Q4_1, Q4_K, Q6_K read from GGUF)."""

from layers.quantized.embedding import QuantizedEmbedding
from layers.quantized.formats import (
    ACTIVATIONS,
    NF4_LEVELS,
    SIGNED_LEVELS,
    UNSIGNED_LEVELS,
    Int4Weight,
    Int8Weight,
    PackedWeight,
    Q4KWeight,
    Q6KWeight,
    check_cols,
    pack_high_bits,
    pack_nibbles,
    unpack_high_bits,
    unpack_nibbles,
    with_activations,
)
from layers.quantized.linear import QuantizedLinear
from layers.quantized.quantize import DEFAULT_GROUP, KINDS, NF4_MAX_HALF_GAP, Kind, group_size, pack

__all__ = [
    "ACTIVATIONS",
    "DEFAULT_GROUP",
    "KINDS",
    "NF4_LEVELS",
    "NF4_MAX_HALF_GAP",
    "SIGNED_LEVELS",
    "UNSIGNED_LEVELS",
    "Int4Weight",
    "Int8Weight",
    "Kind",
    "PackedWeight",
    "Q4KWeight",
    "Q6KWeight",
    "QuantizedEmbedding",
    "QuantizedLinear",
    "check_cols",
    "group_size",
    "pack",
    "pack_high_bits",
    "pack_nibbles",
    "unpack_high_bits",
    "unpack_nibbles",
    "with_activations",
]
