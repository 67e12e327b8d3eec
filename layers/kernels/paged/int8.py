"""int8 pools: each token's key (or value, or latent) of each K/V head stored as int8 numbers with
one scale, so a page holds about half the bytes of bfloat16 pages and a quarter of float32 ones.

Layout (beside pages.py's): `values [*layers, kv_heads, pages, page_size, head_dim]` int8 and
`scales [*layers, kv_heads, pages, page_size]` bfloat16; the stored number is
`round(x / scale)` with `scale = max|x| / 127` over the token's `head_dim` numbers (symmetric,
absmax, per token and head as in LLM.int8's vector-wise quantization, Dettmers et al. 2022).

Why per (token, head) and not per page: a page fills one token at a time, so a per-page scale is
either fixed by the page's first tokens (a later, larger key clips) or grows and re-quantizes the
tokens already written (each re-quantization adds another rounding). A token's own scale is
computed once, when it is written, and every number's error stays at most half its step,
`scale / 2 <= max|x| / 254`. The price is the scale: 2 bytes per token and head, `2 / head_dim`
of the int8 bytes (3% at head_dim 64).

Why bfloat16 scales: the scale is rounded to bfloat16 *before* the numbers are divided by it, so
its rounding moves the step (by at most 2^-8 of it), never the error bound of half a step;
bfloat16 keeps float32's exponent range, so no key is too small or too large for its scale.

Attention never dequantizes a page in memory: the kernels read the int8 numbers, multiply the
scores by the keys' scales and the softmax weights by the values' scales (blocked.py, decode.py),
which is attention over the dequantized values `values * scales` exactly.
"""

import equinox as eqx
import jax.numpy as jnp
from jaxtyping import Array, Float, Int8

SCALE_DTYPE = "bfloat16"
LEVELS = 127  # symmetric: -127..127, so negating a key negates its numbers


class Int8Pages(eqx.Module):
    """One pool (keys, values or latents) in int8 with a scale per token and head; `axes` the
    pool's logical axis names (sharding), the scales' being all but the last."""

    values: Int8[Array, "*layers kv_heads pages page_size head_dim"]
    scales: Float[Array, "*layers kv_heads pages page_size"]
    axes: tuple[str, ...] = eqx.field(static=True)

    @staticmethod
    def zeros(shape: tuple[int, ...], axes: tuple[str, ...]) -> "Int8Pages":
        return Int8Pages(jnp.zeros(shape, jnp.int8), jnp.zeros(shape[:-1], SCALE_DTYPE), axes)

    # The pool's shape and dtype as paged attention checks them: the numbers'.
    @property
    def shape(self) -> tuple[int, ...]:
        return self.values.shape

    @property
    def ndim(self) -> int:
        return self.values.ndim

    @property
    def dtype(self):
        return self.values.dtype

    def logical_axes(self) -> dict[str, tuple[str, ...]]:
        return {"values": self.axes, "scales": self.axes[:-1]}


def quantize(
    x: Float[Array, "*tokens head_dim"],
) -> tuple[Int8[Array, "*tokens head_dim"], Float[Array, " *tokens"]]:
    """Symmetric absmax int8 over the last axis: numbers and bfloat16 scales with
    `|numbers * scales - x| <= scales / 2` (an all-zero vector gets scale 0 and zeros)."""
    x = x.astype(jnp.float32)
    scale = (jnp.max(jnp.abs(x), axis=-1) / LEVELS).astype(SCALE_DTYPE)
    wide = scale.astype(jnp.float32)
    safe = jnp.where(wide > 0, wide, 1.0)[..., None]
    # Rounded down, the bfloat16 scale may put max|x| / scale just past 127: clipped, still
    # within half a step.
    numbers = jnp.clip(jnp.round(x / safe), -LEVELS, LEVELS).astype(jnp.int8)
    return numbers, scale


def dequantize(pool: Int8Pages) -> Float[Array, "*layers kv_heads pages page_size head_dim"]:
    """The float32 numbers a pool stands for (tests and conversions; the kernels fold the
    scales into scores and weights instead)."""
    return pool.values.astype(jnp.float32) * pool.scales.astype(jnp.float32)[..., None]
