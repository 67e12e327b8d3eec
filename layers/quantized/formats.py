"""Weight matrices held in packed blocks with their scales: the typed storage of every quantized
layer (`QuantizedLinear`, `QuantizedEmbedding`, `QuantizedExperts`).

A `PackedWeight` is a matrix `W [*lead, rows, cols]`: `rows` are the outputs (a projection's
flattened out_shape, a vocabulary's tokens), `cols` the inputs they dot with (flattened in_shape,
the embedding width), `lead` any stacked layers or experts. Consecutive runs of `group` weights
(16 or a multiple of 32) along a row share a scale (and, where the format has one, a minimum).
Rows are contiguous, as llama.cpp lays its blocks out, so a matrix-vector product streams each
row once and the CPU kernel (layers/kernels/quantized) dequantizes it in registers.

Four layouts cover every format the zoo holds (cols % 32 == 0 for all of them):

| class        | codes                            | per group                 | formats            |
|--------------|----------------------------------|---------------------------|--------------------|
| `Int8Weight` | int8 `[.., rows, cols]`          | scale f32 or f16          | int8, Q8_0         |
| `Int4Weight` | 4 bits, 16 bytes per 32 weights  | scale (+ min), 16 levels  | int4 nf4 Q4_0 Q4_1 |
| `Q4KWeight`  | as Int4Weight                    | 6-bit scale, min; f16/256 | Q4_K               |
| `Q6KWeight`  | low 4 bits as Int4Weight, high 2 | int8 scale; f16/256       | Q6_K               |

4-bit packing: the 16 bytes of each 32-weight chunk hold weight j in the low nibble of byte j
and weight j + 16 in the high nibble (llama.cpp's Q4_0/Q4_1 order). Q6_K's high bits: 4 bytes
per 16 weights, byte b holding weights b, b + 4, b + 8, b + 12 in bit pairs 0, 2, 4, 6. An
`Int4Weight` maps each code through its 16 `levels` (NF4's quantiles, or the integers: code - 8
for the symmetric int4 and Q4_0, the code itself for asymmetric int4 and Q4_1, which add a
per-group minimum).

`activations` ("float", the default, or "int8") is what the CPU kernel does with x at decode:
"float" keeps x as it is; "int8" rounds it per 32 inputs to int8 codes and a step first
(llama.cpp's Q8_0 activations, `layers.kernels.quantized.quantize_activations`) so that codes
multiply codes in integers (AVX-512 VNNI): for groups of 32 the faster path at every token
count measured (bench/RESULTS.md, "Int8 activations sixteen rows a vector"), which a GGUF model
loads with where the CPU has it (`layers.kernels.quantized.default_activations`). "float"
rounds nothing. `with_activations(tree, mode)` sets it on every packed weight of a model.
Prefill and training (the dequantize + XLA path) and the GPU kernel always take x as it is.

Scales and minimums keep the precision their format stores: llama.cpp's float16, float32 for the
zoo's own int8 and nf4 scales (a bfloat16 scale would add its own 2^-8 relative error to every
weight it scales). The k-quants keep their two-level scales as llama.cpp does (small integer
sub-scales of a float16 scale per 256 weights): their products are exact in float32.
"""

import abc
import dataclasses
from typing import ClassVar, Literal, get_args

import equinox as eqx
import jax
import jax.numpy as jnp
from jax.typing import DTypeLike
from jaxtyping import Array, Float, Int, Integer

Activations = Literal["int8", "float"]
ACTIVATIONS: tuple[str, ...] = get_args(Activations)
CHUNK = 32  # weights per packed chunk: every format needs cols % CHUNK == 0
SUPER = 256  # weights per k-quant super-block

# The 16 NF4 levels (QLoRA appendix E; bitsandbytes' `create_normal_map`): quantiles of N(0, 1)
# rescaled to [-1, 1], with an exact zero.
NF4_LEVELS = (
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
)
SIGNED_LEVELS = tuple(float(c - 8) for c in range(16))  # symmetric int4 and Q4_0: code - 8
UNSIGNED_LEVELS = tuple(float(c) for c in range(16))  # asymmetric int4, Q4_1 and Q4_K: code


def unpack_nibbles(packed: Integer[Array, "... half"]) -> Int[Array, "... cols"]:
    """[..., cols / 2] packed bytes -> [..., cols] 4-bit codes (int32), in weight order."""
    chunks = packed.astype(jnp.int32).reshape(*packed.shape[:-1], -1, CHUNK // 2)
    return jnp.concatenate([chunks & 15, chunks >> 4], axis=-1).reshape(*packed.shape[:-1], -1)


def pack_nibbles(codes: Integer[Array, "... cols"]) -> Integer[Array, "... half"]:
    """[..., cols] codes in [0, 16) -> [..., cols / 2] uint8, 16 bytes per 32-weight chunk."""
    chunks = codes.astype(jnp.uint8).reshape(*codes.shape[:-1], -1, 2, CHUNK // 2)
    return (chunks[..., 0, :] | (chunks[..., 1, :] << 4)).reshape(*codes.shape[:-1], -1)


def unpack_high_bits(high: Integer[Array, "... quarter"]) -> Int[Array, "... cols"]:
    """Q6_K's high planes [..., cols / 4] -> [..., cols] 2-bit values (int32)."""
    four = high.astype(jnp.int32).reshape(*high.shape[:-1], -1, 1, 4)
    pairs = (four >> jnp.array([0, 2, 4, 6]).reshape(4, 1)) & 3  # [..., cols/16, 4 pairs, 4 bytes]
    return pairs.reshape(*high.shape[:-1], -1)


def pack_high_bits(values: Integer[Array, "... cols"]) -> Integer[Array, "... quarter"]:
    """[..., cols] values in [0, 4) -> [..., cols / 4] uint8 (the inverse of unpack_high_bits)."""
    v = values.astype(jnp.uint8).reshape(*values.shape[:-1], -1, 4, 4)  # [.., cols/16, pair, b]
    packed = v[..., 0, :] | (v[..., 1, :] << 2) | (v[..., 2, :] << 4) | (v[..., 3, :] << 6)
    return packed.reshape(*values.shape[:-1], -1)


def _per_group(values: Float[Array, "... cols"], per_group: Float[Array, "... groups"], op):
    """`op(values grouped [..., groups, group], per_group[..., groups, 1])` back to [..., cols]."""
    grouped = values.reshape(*per_group.shape, -1)
    return op(grouped, per_group[..., None]).reshape(values.shape)


def check_cols(cols: int, group: int, *, what: str) -> None:
    """Clear errors for a row length or group size a packed format cannot hold."""
    if cols % CHUNK:
        raise ValueError(
            f"{what}: {cols} inputs per row is not a multiple of {CHUNK}, which every packed "
            "format needs (weights are packed in 32-weight chunks)"
        )
    if group < 1 or cols % group or (group % CHUNK and group != 16):
        raise ValueError(
            f"{what}: group size {group} must divide the {cols} inputs of a row and be 16 or a "
            f"multiple of {CHUNK}"
        )


class PackedWeight(eqx.Module):
    """`W [*lead, rows, cols]` in packed blocks (see the module docstring); every array of it is
    `[*lead, rows, ...]`, so rows can be gathered (`take`) or sliced array by array.

    `kernel_format`, `kernel_arrays()` and `kernel_attrs()` are what the CPU kernel takes;
    `dequantize()` is the specification every kernel is tested against.
    """

    kernel_format: ClassVar[str]

    group: eqx.AbstractVar[int]
    axes: eqx.AbstractVar[tuple[str, ...]]
    name: eqx.AbstractVar[str]
    activations: eqx.AbstractVar[str]

    def __check_init__(self):
        if self.activations not in ACTIVATIONS:
            raise ValueError(
                f"activations {self.activations!r} is not one of {ACTIVATIONS} (how the CPU "
                "kernel takes x: rounded to int8 per 32 inputs, or as it is)"
            )

    @abc.abstractmethod
    def dequantize(self, dtype: DTypeLike = jnp.float32) -> Float[Array, "... rows cols"]:
        """The float matrix `[*lead, rows, cols]` (computed in float32, returned in `dtype`)."""

    @abc.abstractmethod
    def kernel_arrays(self) -> tuple[Array, ...]:
        """The arrays the CPU kernel reads, in its order for this format."""

    def kernel_attrs(self) -> dict:
        """The kernel's attributes for this format: whether 4-bit levels are `code + offset`
        (computed, not looked up) and that offset."""
        return {"linear": True, "offset": 0.0}

    @property
    def shape(self) -> tuple[int, int]:
        """(rows, cols) of one matrix."""
        first = self.kernel_arrays()[0]
        return first.shape[-2], self.cols

    @property
    @abc.abstractmethod
    def cols(self) -> int: ...

    @property
    def lead(self) -> tuple[int, ...]:
        """Leading dims (stacked layers, experts) before `rows`."""
        return self.kernel_arrays()[0].shape[:-2]

    def take(
        self, index: Int[Array, "*index"], dtype: DTypeLike = jnp.float32
    ) -> Float[Array, "*index cols"]:
        """Rows `index` dequantized (an embedding lookup): gathered packed, then expanded, so
        only the rows asked for are ever in float."""
        rows = jax.tree.map(lambda a: jnp.take(a, index, axis=-2), self)
        return rows.dequantize(dtype)

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in jax.tree.leaves(self))

    def logical_axes(self) -> dict[str, tuple[str, ...]]:
        """Every array is `[*axes[:-1], <per-row data>]`: named by the matrix's axes (the last,
        the input axis, also names the packed, grouped and super-block dims it is split into)."""
        return {
            field: self.axes
            for field, value in vars(self).items()
            if isinstance(value, jax.Array | jax.ShapeDtypeStruct)
        }


class Int8Weight(PackedWeight):
    """int8 codes, one scale per group: `w = code * scale` (the zoo's int8: absmax / 127 per
    group or per output channel, float32 scales; llama.cpp's Q8_0: groups of 32, float16)."""

    codes: Integer[Array, "..."]
    scales: Float[Array, "..."]
    group: int = eqx.field(static=True)
    axes: tuple[str, ...] = eqx.field(static=True)
    name: str = eqx.field(static=True, default="int8")
    activations: Activations = eqx.field(static=True, default="float")
    kernel_format: ClassVar[str] = "i8"

    @property
    def cols(self) -> int:
        return self.codes.shape[-1]

    def dequantize(self, dtype: DTypeLike = jnp.float32) -> Float[Array, "... rows cols"]:
        w = _per_group(
            self.codes.astype(jnp.float32), self.scales.astype(jnp.float32), jnp.multiply
        )
        return w.astype(dtype)

    def kernel_arrays(self) -> tuple[Array, ...]:
        return (self.codes, self.scales)


class Int4Weight(PackedWeight):
    """4-bit codes through 16 `levels`, one scale (and minimum, if `mins`) per group:
    `w = levels[code] * scale (+ min)`. The zoo's nf4 (NF4 levels, absmax scales in float32,
    QLoRA) and int4 (asymmetric: codes 0..15, float16 scale and minimum); llama.cpp's Q4_0
    (code - 8, float16 scale) and Q4_1 (code, float16 scale and minimum), groups of 32."""

    codes: Integer[Array, "..."]
    scales: Float[Array, "..."]
    mins: Float[Array, "..."] | None
    levels: tuple[float, ...] = eqx.field(static=True)
    group: int = eqx.field(static=True)
    axes: tuple[str, ...] = eqx.field(static=True)
    name: str = eqx.field(static=True, default="int4")
    activations: Activations = eqx.field(static=True, default="float")
    kernel_format: ClassVar[str] = "u4"

    def __check_init__(self):  # PackedWeight's check runs too (equinox runs every class's)
        if len(self.levels) != 16:
            raise ValueError(f"a 4-bit format needs 16 levels, got {len(self.levels)}")

    @property
    def cols(self) -> int:
        return 2 * self.codes.shape[-1]

    @property
    def linear_offset(self) -> float | None:
        """c such that levels[i] == i + c for every code (None for a table like NF4's)."""
        offset = self.levels[0]
        linear = all(level == i + offset for i, level in enumerate(self.levels))
        return offset if linear else None

    def dequantize(self, dtype: DTypeLike = jnp.float32) -> Float[Array, "... rows cols"]:
        values = jnp.asarray(self.levels, jnp.float32)[unpack_nibbles(self.codes)]
        w = _per_group(values, self.scales.astype(jnp.float32), jnp.multiply)
        if self.mins is not None:
            w = _per_group(w, self.mins.astype(jnp.float32), jnp.add)
        return w.astype(dtype)

    def kernel_arrays(self) -> tuple[Array, ...]:
        table = jnp.asarray(self.levels, jnp.float32)
        mins = () if self.mins is None else (self.mins,)
        return (self.codes, self.scales, *mins, table)

    def kernel_attrs(self) -> dict:
        offset = self.linear_offset
        return {"linear": offset is not None, "offset": 0.0 if offset is None else offset}


def _super(values: Float[Array, "... groups"], per_super: Float[Array, "... supers"]):
    """Sub-block values times their super-block's (repeated over the groups it covers)."""
    ratio = values.shape[-1] // per_super.shape[-1]
    return values * jnp.repeat(per_super.astype(jnp.float32), ratio, axis=-1)


class Q4KWeight(PackedWeight):
    """llama.cpp's Q4_K: 4-bit codes (Int4Weight's packing), per 32 weights a 6-bit scale `sc`
    and minimum `m`, per 256 a float16 `d` and `dmin`: `w = d sc code - dmin m`."""

    codes: Integer[Array, "..."]
    sub_scales: Integer[Array, "..."]
    sub_mins: Integer[Array, "..."]
    d: Float[Array, "..."]
    dmin: Float[Array, "..."]
    axes: tuple[str, ...] = eqx.field(static=True)
    group: int = eqx.field(static=True, default=32)
    name: str = eqx.field(static=True, default="q4_k")
    activations: Activations = eqx.field(static=True, default="float")
    kernel_format: ClassVar[str] = "q4k"

    @property
    def cols(self) -> int:
        return 2 * self.codes.shape[-1]

    def dequantize(self, dtype: DTypeLike = jnp.float32) -> Float[Array, "... rows cols"]:
        scales = _super(self.sub_scales.astype(jnp.float32), self.d)
        mins = _super(self.sub_mins.astype(jnp.float32), self.dmin)
        w = _per_group(unpack_nibbles(self.codes).astype(jnp.float32), scales, jnp.multiply)
        return _per_group(w, mins, jnp.subtract).astype(dtype)

    def kernel_arrays(self) -> tuple[Array, ...]:
        return (self.codes, self.sub_scales, self.sub_mins, self.d, self.dmin)


class Q6KWeight(PackedWeight):
    """llama.cpp's Q6_K: 6-bit codes (low 4 bits packed as Int4Weight's, the high 2 in their own
    planes), per 16 weights an int8 scale `sc`, per 256 a float16 `d`: `w = d sc (code - 32)`."""

    low: Integer[Array, "..."]
    high: Integer[Array, "..."]
    sub_scales: Integer[Array, "..."]
    d: Float[Array, "..."]
    axes: tuple[str, ...] = eqx.field(static=True)
    group: int = eqx.field(static=True, default=16)
    name: str = eqx.field(static=True, default="q6_k")
    activations: Activations = eqx.field(static=True, default="float")
    kernel_format: ClassVar[str] = "q6k"

    @property
    def cols(self) -> int:
        return 2 * self.low.shape[-1]

    def dequantize(self, dtype: DTypeLike = jnp.float32) -> Float[Array, "... rows cols"]:
        codes = unpack_nibbles(self.low) | (unpack_high_bits(self.high) << 4)
        scales = _super(self.sub_scales.astype(jnp.float32), self.d)
        w = _per_group((codes - 32).astype(jnp.float32), scales, jnp.multiply)
        return w.astype(dtype)

    def kernel_arrays(self) -> tuple[Array, ...]:
        return (self.low, self.high, self.sub_scales, self.d)

    def kernel_attrs(self) -> dict:
        return {"linear": True, "offset": -32.0}


FORMATS: tuple[type[PackedWeight], ...] = (Int8Weight, Int4Weight, Q4KWeight, Q6KWeight)


def with_activations(tree, activations: Activations):
    """`tree` (a model, a layer) with every packed weight's `activations` set (see the module
    docstring); nothing else changes, no array is copied."""
    if activations not in ACTIVATIONS:
        raise ValueError(f"activations {activations!r} is not one of {ACTIVATIONS}")

    def one(leaf):
        if isinstance(leaf, PackedWeight):
            return dataclasses.replace(leaf, activations=activations)
        return leaf

    return jax.tree.map(one, tree, is_leaf=lambda leaf: isinstance(leaf, PackedWeight))
