"""llama.cpp's quantized blocks -> the zoo's packed weights (layers/quantized/formats.py), integer
work only: the codes are regrouped and the scales kept in their own precision, so nothing goes
through float and the weights are exactly the ones llama.cpp (and the `gguf` package's
dequantizer) compute.

A GGUF tensor `[rows, cols]` is `rows` rows of `cols / block` blocks, each block its scales then
its codes:
- Q8_0 (32 weights, 34 bytes): f16 d, int8 q[32]; w = d q.
- Q4_0 (32, 18): f16 d, q[16] two 4-bit codes per byte (j low, j + 16 high); w = d (q - 8).
- Q4_1 (32, 20): f16 d, f16 m, q[16] as Q4_0; w = d q + m.
- Q4_K (256, 144): f16 d, f16 dmin, 12 bytes of eight 6-bit scales sc and mins m, q[128]: each
  32 bytes hold 64 weights, the first 32 in the low nibbles; w = d sc q - dmin m per 32 weights.
- Q6_K (256, 210): ql[128] low 4 bits (each 64 bytes: 128 weights, low nibbles first), qh[64]
  high 2 bits (each 32 bytes: 128 weights, 4 bit pairs per byte), int8 sc[16], f16 d;
  w = d sc (q - 32) per 16 weights.
(ggml-common.h / ggml-quants.c; the gguf package's quants.py reads them the same way.)

`PACKED_TYPES` lists what is implemented; any other quantized type is an error that names it.
"""

import dataclasses

import gguf
import jax.numpy as jnp
import numpy as np

from layers.kernels.quantized import default_activations
from layers.quantized import (
    SIGNED_LEVELS,
    UNSIGNED_LEVELS,
    Int4Weight,
    Int8Weight,
    PackedWeight,
    Q4KWeight,
    Q6KWeight,
)

Q = gguf.GGMLQuantizationType
FLOAT_TYPES = (Q.F32, Q.F16, Q.BF16)


@dataclasses.dataclass(frozen=True)
class PackedRows:
    """One tensor's rows in a packed format: numpy arrays, rows first in each (`[rows, ...]`),
    and what builds the `PackedWeight` (`kind`, its static fields)."""

    kind: type[PackedWeight]
    arrays: dict[str, np.ndarray | None]
    static: dict

    @property
    def rows(self) -> int:
        return next(a for a in self.arrays.values() if a is not None).shape[0]

    @property
    def type_name(self) -> str:
        return self.static["name"].upper()

    def take(self, index: np.ndarray | slice) -> "PackedRows":
        """These rows (a slice, or an index array: llama.cpp's Q/K row order undone)."""
        arrays = {k: None if a is None else a[index] for k, a in self.arrays.items()}
        return dataclasses.replace(self, arrays=arrays)

    def weight(self, axes: tuple[str, ...]) -> PackedWeight:
        """The packed weight, on the default device (`jax.device_put` moves it to a sharding),
        with `default_activations()`: on a CPU with AVX-512 VNNI its kernel rounds x per 32
        inputs to int8 (llama.cpp's own Q8 activations) and multiplies codes in integers, the
        faster path; this rounding flips some of SmolLM2's greedy tokens against the
        dequantized file's, which `layers.quantized.with_activations(model, "float")` keeps."""
        arrays = {k: None if a is None else jnp.asarray(a) for k, a in self.arrays.items()}
        return self.kind(**arrays, **self.static, axes=axes, activations=default_activations())


def _blocks(data: np.ndarray, rows: int, block_bytes: int) -> np.ndarray:
    """The tensor's bytes as [rows, blocks per row, block_bytes]."""
    return np.asarray(data, np.uint8).reshape(rows, -1, block_bytes)


def _half(blocks: np.ndarray, start: int) -> np.ndarray:
    """The float16 at byte `start` of every block: [rows, blocks]."""
    return np.ascontiguousarray(blocks[..., start : start + 2]).view(np.float16)[..., 0]


def _flat(a: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(a.reshape(a.shape[0], -1))


def _pack_nibbles(codes: np.ndarray) -> np.ndarray:
    """[rows, cols] codes in [0, 16) -> [rows, cols / 2] in the zoo's order (16 bytes per 32
    weights: j low, j + 16 high): llama.cpp's Q4_0/Q4_1 order."""
    chunks = codes.astype(np.uint8).reshape(codes.shape[0], -1, 2, 16)
    return _flat(chunks[:, :, 0] | (chunks[:, :, 1] << 4))


def _pack_high_bits(values: np.ndarray) -> np.ndarray:
    """[rows, cols] values in [0, 4) -> [rows, cols / 4]: per 16 weights 4 bytes, byte b holding
    weights b, b + 4, b + 8, b + 12 in bit pairs 0, 2, 4, 6."""
    v = values.astype(np.uint8).reshape(values.shape[0], -1, 4, 4)
    return _flat(v[:, :, 0] | (v[:, :, 1] << 2) | (v[:, :, 2] << 4) | (v[:, :, 3] << 6))


def q8_0(data: np.ndarray, rows: int) -> PackedRows:
    blocks = _blocks(data, rows, 34)
    codes = _flat(np.ascontiguousarray(blocks[..., 2:]).view(np.int8))
    arrays = {"codes": codes, "scales": _half(blocks, 0)}
    return PackedRows(Int8Weight, arrays, {"group": 32, "name": "q8_0"})


def q4_0(data: np.ndarray, rows: int) -> PackedRows:
    blocks = _blocks(data, rows, 18)
    arrays = {"codes": _flat(blocks[..., 2:]), "scales": _half(blocks, 0), "mins": None}
    return PackedRows(Int4Weight, arrays, {"levels": SIGNED_LEVELS, "group": 32, "name": "q4_0"})


def q4_1(data: np.ndarray, rows: int) -> PackedRows:
    blocks = _blocks(data, rows, 20)
    arrays = {"codes": _flat(blocks[..., 4:]), "scales": _half(blocks, 0), "mins": _half(blocks, 2)}
    static = {"levels": UNSIGNED_LEVELS, "group": 32, "name": "q4_1"}
    return PackedRows(Int4Weight, arrays, static)


def _k_scales(packed: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K's 12 bytes -> eight 6-bit scales and eight 6-bit mins ([..., 8] each): bytes 0-3 hold
    scales 0-3 (low 6 bits) and the top 2 bits of scales 4-7, bytes 4-7 the same for mins, bytes
    8-11 the low 4 bits of scales 4-7 (low nibble) and mins 4-7 (high nibble)."""
    d, m, low = packed[..., 0:4], packed[..., 4:8], packed[..., 8:12]
    scales = np.concatenate([d & 0x3F, (low & 0x0F) | ((d >> 2) & 0x30)], axis=-1)
    mins = np.concatenate([m & 0x3F, (low >> 4) | ((m >> 2) & 0x30)], axis=-1)
    return scales, mins


def q4_k(data: np.ndarray, rows: int) -> PackedRows:
    blocks = _blocks(data, rows, 144)
    scales, mins = _k_scales(blocks[..., 4:16])
    q = blocks[..., 16:].reshape(rows, -1, 4, 1, 32)  # [rows, supers, 64-weight run, _, 32 bytes]
    codes = np.concatenate([q & 15, q >> 4], axis=-2)  # low nibbles: the run's first 32
    arrays = {
        "codes": _pack_nibbles(codes.reshape(rows, -1)),
        "sub_scales": _flat(scales),
        "sub_mins": _flat(mins),
        "d": _half(blocks, 0),
        "dmin": _half(blocks, 2),
    }
    return PackedRows(Q4KWeight, arrays, {"name": "q4_k"})


def q6_k(data: np.ndarray, rows: int) -> PackedRows:
    blocks = _blocks(data, rows, 210)
    ql = blocks[..., :128].reshape(rows, -1, 2, 1, 64)  # [.., 128-weight half, _, 64 bytes]
    low = np.concatenate([ql & 15, ql >> 4], axis=-2)  # [.., half, 2 x 64 weights]
    qh = blocks[..., 128:192].reshape(rows, -1, 2, 1, 32)
    high = (qh >> np.array([0, 2, 4, 6], np.uint8).reshape(4, 1)) & 3  # [.., half, 4 x 32]
    arrays = {
        "low": _pack_nibbles(low.reshape(rows, -1)),
        "high": _pack_high_bits(high.reshape(rows, -1)),
        "sub_scales": _flat(np.ascontiguousarray(blocks[..., 192:208]).view(np.int8)),
        "d": _half(blocks, 208),
    }
    return PackedRows(Q6KWeight, arrays, {"name": "q6_k"})


PACKED_TYPES = {Q.Q8_0: q8_0, Q.Q4_0: q4_0, Q.Q4_1: q4_1, Q.Q4_K: q4_k, Q.Q6_K: q6_k}


def packed_rows(data: np.ndarray, tensor_type: Q, rows: int, name: str) -> PackedRows | None:
    """The tensor's blocks as packed rows; None for a float tensor (F32, F16, BF16). A quantized
    type without a packed layout here is an error naming it and the tensor."""
    if tensor_type in FLOAT_TYPES:
        return None
    if tensor_type not in PACKED_TYPES:
        raise ValueError(
            f"GGUF tensor {name!r} is {tensor_type.name}, which the zoo does not keep packed "
            f"(it keeps {', '.join(t.name for t in PACKED_TYPES)}); load it dequantized to "
            "float32 with load_pretrained(path, quantized=False)"
        )
    return PACKED_TYPES[tensor_type](data, rows)
