"""Float matrices -> packed weights: the zoo's own formats (llama.cpp's come packed from GGUF).

`pack(w, kind, group=..., axes=...)` quantizes `W [*lead, rows, cols]` (rows = outputs) group by
group along each row:

- `"int8"`: symmetric absmax, `scale = max |w| / 127`, `code = round(w / scale)` in [-127, 127]
  (LLM.int8's vector-wise quantization without its outlier split, Dettmers et al. 2022); `group`
  None is one scale per row (per output channel). Error per weight <= scale / 2 (+ float32
  rounding).
- `"int4"`: asymmetric min/max per group (llama.cpp's Q4_1, GPTQ's and torchao's zero point):
  codes 0..15, `w ~ code * scale + min` with scale and min in float16. The float16 minimum is
  rounded down and the scale rounded up from (max - min16) / 15, so the 16 levels always span
  the group: error per weight <= scale / 2 (+ float32 rounding), no clipping.
- `"nf4"`: 4-bit NormalFloat (QLoRA, section 3): each group divided by its absmax and rounded to
  the nearest of the 16 NF4 levels; absmax in float32. Error per weight <= NF4_MAX_HALF_GAP x
  absmax (+ float32 rounding).
"""

import functools
from typing import Literal, get_args

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float

from layers.quantized.formats import (
    NF4_LEVELS,
    UNSIGNED_LEVELS,
    Int4Weight,
    Int8Weight,
    PackedWeight,
    check_cols,
    pack_nibbles,
)

Kind = Literal["int8", "int4", "nf4"]
KINDS: tuple[str, ...] = get_args(Kind)
# Default group sizes: int8 per output channel (None), int4 as llama.cpp's Q4_1, nf4 as QLoRA.
DEFAULT_GROUP: dict[str, int | None] = {"int8": None, "int4": 32, "nf4": 64}
INT8_MAX = 127
NF4_MAX_HALF_GAP = float(np.max(np.diff(np.asarray(NF4_LEVELS))) / 2)
NF4_MIDPOINTS = (np.asarray(NF4_LEVELS[1:]) + np.asarray(NF4_LEVELS[:-1])) / 2


def group_size(kind: str, group: int | None, cols: int) -> int:
    """The group a `kind` quantization of `cols`-wide rows uses (`group`, or the kind's
    default; None for int8 is the whole row), with clear errors for a bad kind or size."""
    if kind not in KINDS:
        raise ValueError(f"quantization kind {kind!r} is not one of {KINDS}")
    group = DEFAULT_GROUP[kind] if group is None else group
    if group is None:  # int8 per output channel: one group spans the row
        group = cols
    if kind != "int8" and group % 2:
        raise ValueError(f"{kind} group size {group} must be even (two 4-bit codes per byte)")
    return group


def pack(
    w: Float[Array, "... rows cols"],
    kind: Kind,
    *,
    group: int | None = None,
    axes: tuple[str, ...],
    what: str = "weight",
) -> PackedWeight:
    """`w` quantized as `kind` in groups of `group` along each row (default per kind: int8 one
    scale per row, int4 32, nf4 64). `axes` names the matrix's trailing dims (rows, cols last);
    `what` names it in errors."""
    cols = w.shape[-1]
    group = group_size(kind, group, cols)
    check_cols(cols, group, what=f"{what} ({kind})")
    return _packed(w, kind, group, axes)


# One program per weight shape and kind: eagerly, each of its dozen ops would compile for every
# new shape and pass over the whole weight once.
@functools.partial(jax.jit, static_argnames=("kind", "group", "axes"))
def _packed(w: Float[Array, "... rows cols"], kind: Kind, group: int, axes: tuple[str, ...]):
    """`pack`'s arithmetic, for a `group` that divides the columns (`pack` checks it)."""
    cols = w.shape[-1]
    grouped = w.astype(jnp.float32).reshape(*w.shape[:-1], cols // group, group)
    if kind == "int8":
        scales = jnp.max(jnp.abs(grouped), axis=-1) / INT8_MAX
        # An all-zero group: any divisor gives code 0, and scale 0 dequantizes it exactly.
        safe = jnp.where(scales > 0, scales, 1.0)[..., None]
        codes = jnp.clip(jnp.round(grouped / safe), -INT8_MAX, INT8_MAX).astype(jnp.int8)
        return Int8Weight(codes.reshape(w.shape), scales, group=group, axes=axes)
    if kind == "int4":
        low = _round_half(jnp.min(grouped, axis=-1), down=True)
        spread = jnp.max(grouped, axis=-1) - low.astype(jnp.float32)
        scales = _round_half(spread / 15, down=False)
        safe = jnp.where(scales > 0, scales.astype(jnp.float32), 1.0)[..., None]
        codes = jnp.round((grouped - low.astype(jnp.float32)[..., None]) / safe)
        codes = jnp.clip(codes, 0, 15).astype(jnp.uint8).reshape(w.shape)
        return Int4Weight(
            pack_nibbles(codes), scales, low, levels=UNSIGNED_LEVELS, group=group, axes=axes
        )
    absmax = jnp.max(jnp.abs(grouped), axis=-1)
    safe = jnp.where(absmax > 0, absmax, 1.0)[..., None]
    # The nearest level, by the midpoints between levels: no [*W, 16] distance table (a 7B
    # model's stacked MLP weight would need tens of GB for it).
    codes = jnp.searchsorted(jnp.asarray(NF4_MIDPOINTS, jnp.float32), grouped / safe)
    return Int4Weight(
        pack_nibbles(codes.reshape(w.shape)),
        absmax,
        None,
        levels=NF4_LEVELS,
        group=group,
        axes=axes,
        name="nf4",
    )


def _round_half(x: Float[Array, "..."], *, down: bool) -> Float[Array, "..."]:
    """`x` in float16, rounded toward -inf (`down`) or +inf instead of to nearest."""
    half = x.astype(jnp.float16)
    wrong = half.astype(jnp.float32) > x if down else half.astype(jnp.float32) < x
    toward = jnp.asarray(-jnp.inf if down else jnp.inf, jnp.float16)
    return jnp.where(wrong, jnp.nextafter(half, toward), half)
