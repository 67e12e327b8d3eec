"""The Pallas GPU kernel (through Triton): `x · W^T` for a packed weight, the codes dequantized in
registers tile by tile, never written out in float.

Grid (rows / block_rows, splits): one program owns `block_rows` output rows and 1/splits of the
inputs, which it walks in tiles of `block_cols`: it loads the tile's codes (int8, or bytes of
two 4-bit codes) and the tile's scales (and minimums), scales them in registers, rounds them to
x's dtype (the specification's `weight.dequantize(x.dtype)`) and multiplies them into its
`[tokens, block_rows]` float32 accumulator with Triton's matrix product. The splits' partial sums
are added after the kernel (split-K): a decode product has few output rows (2048 rows are 32
programs of 64), too few to keep an H100's 132 SMs reading, so the inputs are divided too.
Triton's product needs every side >= 16 and every shape a power of two, so the tokens are padded
with zero rows to max(16, next power of two) and the tiles are the largest powers of two dividing
the weight.

The defaults (64-row blocks, 256-weight tiles, up to 8 splits, 8 warps) are the fastest of a sweep
on an H100 (bench/RESULTS.md, "GPU: NVIDIA H100 80GB HBM3, 2026-11-27").

4-bit codes stay in their bytes: byte b of a chunk holds weight b (low nibble) and b + 16 (high
nibble), so x is split once, outside the kernel, into the inputs the low and the high nibbles
multiply (`x_lo`, `x_hi`, `[tokens, cols / 2]`), and each tile is two products of the byte tile's
halves; no nibble is ever moved.

`supports(weight)` says which weights it takes: int8 codes (`Int8Weight`: the zoo's int8, Q8_0)
and 4-bit codes on linear levels (`Int4Weight` with `code + offset` levels: int4, Q4_0, Q4_1),
rows a multiple of 16. NF4's table and the k-quants' two-level scales go through the reference
(dequantize + XLA matmul, which XLA fuses into the product's operand on GPU).
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu
from jaxtyping import Array, Float

from layers.kernels.flash.forward import dot_nt
from layers.quantized.formats import Int4Weight, Int8Weight, PackedWeight

MAX_BLOCK_ROWS = 64
MAX_BLOCK_COLS = 256
MAX_SPLITS = 8


@dataclasses.dataclass(frozen=True, kw_only=True)
class Plan:
    """Everything static about one call of the kernel."""

    four_bit: bool  # codes are bytes of two 4-bit codes (else int8)
    offset: float  # level of code c: c + offset
    group: int  # weights per scale
    has_min: bool
    block_rows: int
    block_cols: int  # weights of a tile along the input (bytes: half that for 4-bit)
    splits: int = 1  # programs along the input, each a partial sum (summed after the kernel)
    num_warps: int = 8
    num_stages: int = 2
    interpret: bool = False


def _power_of_two_dividing(n: int, limit: int) -> int:
    return min(n & -n, limit)


def supports(weight: PackedWeight) -> bool:
    """Whether the kernel takes this weight (see the module docstring)."""
    rows, cols = weight.shape
    if weight.lead or rows % 16 or _power_of_two_dividing(cols, MAX_BLOCK_COLS) < 32:
        return False
    if isinstance(weight, Int8Weight):
        return True
    return isinstance(weight, Int4Weight) and weight.linear_offset is not None


def plan_for(weight: PackedWeight, *, interpret: bool = False) -> Plan:
    rows, cols = weight.shape
    block_cols = _power_of_two_dividing(cols, MAX_BLOCK_COLS)
    tiles = cols // block_cols
    return Plan(
        four_bit=isinstance(weight, Int4Weight),
        offset=weight.kernel_attrs()["offset"],
        group=weight.group,
        has_min=isinstance(weight, Int4Weight) and weight.mins is not None,
        block_rows=_power_of_two_dividing(rows, MAX_BLOCK_ROWS),
        block_cols=block_cols,
        splits=_power_of_two_dividing(tiles, MAX_SPLITS),
        interpret=interpret,
    )


def _scaled(codes, scales_ref, mins_ref, tile, plan: Plan, tile_cols: int):
    """One tile's codes `[rows, tile_cols]` (positions in weights: consecutive, or for a 4-bit
    half: byte columns, each standing for the weights of its chunk) times their group's scale
    (+ minimum), in float32."""
    values = codes.astype(jnp.float32) + plan.offset
    span = plan.group // 2 if plan.four_bit else plan.group  # tile columns per group
    rows = values.shape[0]
    if span >= tile_cols:  # the tile lies inside one group
        at = pl.ds((tile * tile_cols) // span, 1)
        values = values * scales_ref[:, at].astype(jnp.float32)
        if mins_ref is not None:
            values = values + mins_ref[:, at].astype(jnp.float32)
        return values
    groups = tile_cols // span
    at = pl.ds(tile * groups, groups)
    grouped = values.reshape(rows, groups, span) * scales_ref[:, at].astype(jnp.float32)[:, :, None]
    if mins_ref is not None:
        grouped = grouped + mins_ref[:, at].astype(jnp.float32)[:, :, None]
    return grouped.reshape(rows, tile_cols)


def _kernel(*refs, plan: Plan):
    if plan.four_bit:
        x_lo_ref, x_hi_ref, codes_ref, scales_ref, *rest = refs
    else:
        x_ref, codes_ref, scales_ref, *rest = refs
    mins_ref = rest.pop(0) if plan.has_min else None
    (o_ref,) = rest
    tokens, rows = o_ref.shape
    tile_cols = plan.block_cols // 2 if plan.four_bit else plan.block_cols
    per_split = codes_ref.shape[1] // tile_cols // plan.splits
    first = pl.program_id(1) * per_split
    # Both factors in x's dtype: the weight as the specification dequantizes it.
    product = lambda x, w: dot_nt(x, w.astype(x.dtype))  # noqa: E731

    def step(tile, acc):
        cols = pl.ds(pl.multiple_of(tile * tile_cols, tile_cols), tile_cols)
        codes = codes_ref[:, cols]
        if not plan.four_bit:
            w = _scaled(codes, scales_ref, mins_ref, tile, plan, tile_cols)
            return acc + product(x_ref[:, cols], w)
        codes = codes.astype(jnp.int32)
        lo = _scaled(codes & 15, scales_ref, mins_ref, tile, plan, tile_cols)
        hi = _scaled(codes >> 4, scales_ref, mins_ref, tile, plan, tile_cols)
        acc = acc + product(x_lo_ref[:, cols], lo)
        return acc + product(x_hi_ref[:, cols], hi)

    zero = jnp.zeros((tokens, rows), jnp.float32)
    o_ref[...] = jax.lax.fori_loop(first, first + per_split, step, zero)


def pallas_matmul(
    x: Float[Array, "tokens cols"],
    weight: PackedWeight,
    *,
    interpret: bool = False,
    plan: Plan | None = None,
) -> Float[Array, "tokens rows"]:
    """`x · W^T` in x's dtype for a weight `supports` takes (`interpret`: the Pallas
    interpreter, for tests on CPU; `plan`: instead of `plan_for`'s, for sweeps)."""
    if not supports(weight):
        raise ValueError(
            f"the Pallas quantized matmul does not take a {weight.name} weight of shape "
            f"{weight.lead + weight.shape}; see layers/kernels/quantized/pallas.py for what it does"
        )
    plan = plan or plan_for(weight, interpret=interpret)
    tokens = x.shape[0]
    padded = max(16, 1 << (tokens - 1).bit_length())
    x = jnp.pad(x, ((0, padded - tokens), (0, 0)))
    rows, cols = weight.shape
    if plan.four_bit:  # the inputs of the low and high nibbles: [tokens, cols / 2] each
        halves = x.reshape(padded, cols // 32, 2, 16)
        xs = (halves[:, :, 0].reshape(padded, -1), halves[:, :, 1].reshape(padded, -1))
    else:
        xs = (x,)
    arrays = weight.kernel_arrays()[: 3 if plan.has_min else 2]  # codes, scales (, mins)
    by_rows = lambda a: pl.BlockSpec((plan.block_rows, a.shape[1]), lambda i, s: (i, 0))  # noqa: E731
    whole = lambda a: pl.BlockSpec(a.shape, lambda i, s: (0, 0))  # noqa: E731
    out = pl.pallas_call(
        functools.partial(_kernel, plan=plan),
        grid=(rows // plan.block_rows, plan.splits),
        in_specs=[*(whole(a) for a in xs), *(by_rows(a) for a in arrays)],
        out_specs=pl.BlockSpec((None, padded, plan.block_rows), lambda i, s: (s, 0, i)),
        out_shape=jax.ShapeDtypeStruct((plan.splits, padded, rows), jnp.float32),
        compiler_params=plgpu.CompilerParams(num_warps=plan.num_warps, num_stages=plan.num_stages),
        interpret=plan.interpret,
        name="quantized_matmul",
    )(*xs, *arrays)
    return out.sum(0)[:tokens].astype(x.dtype)
