"""Rotary position embeddings (RoFormer, Su et al. 2021) with Llama-3 or linear (position
interpolation, Chen et al. 2023) frequency scaling.

Uses the "rotate half" layout of HF Llama checkpoints: a head vector is split into two halves
(x1, x2) and rotated pairwise as (x1 cos - x2 sin, x2 cos + x1 sin).
"""

import dataclasses
import math
from typing import Literal

import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, Int


@dataclasses.dataclass(frozen=True, kw_only=True)
class RopeScaling:
    """Llama-3.1's frequency scaling: long wavelengths are divided by `factor`, short ones kept,
    and the band between is interpolated smoothly (the "llama3" rope_type in HF configs).
    `kind="linear"`: every frequency divided by `factor`, i.e. positions / factor (HF's "linear";
    Gemma 3's global layers); the other fields are then unused."""

    kind: Literal["llama3", "linear"] = "llama3"
    factor: float = 8.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_seq_len: int = 8192

    def __post_init__(self):
        if self.factor <= 0:
            raise ValueError(f"RopeScaling.factor must be > 0, got {self.factor}")
        if self.kind not in ("llama3", "linear"):
            raise ValueError(f"RopeScaling.kind={self.kind!r} is unknown; choose llama3 or linear")
        if self.kind == "llama3" and self.high_freq_factor <= self.low_freq_factor:
            raise ValueError(
                "RopeScaling.high_freq_factor must exceed low_freq_factor, got "
                f"{self.high_freq_factor} <= {self.low_freq_factor}"
            )


def inverse_frequencies(head_dim: int, theta: float, scaling: RopeScaling | None) -> np.ndarray:
    """The `head_dim / 2` angular frequencies theta^(-2i/head_dim), optionally scaled.
    Computed with NumPy in float64: they are constants of the traced program."""
    inv_freq = 1.0 / theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    if scaling is None:
        return inv_freq
    if scaling.kind == "linear":
        return inv_freq / scaling.factor
    low_wavelen = scaling.original_max_seq_len / scaling.low_freq_factor
    high_wavelen = scaling.original_max_seq_len / scaling.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = np.where(wavelen > low_wavelen, inv_freq / scaling.factor, inv_freq)
    smooth = (scaling.original_max_seq_len / wavelen - scaling.low_freq_factor) / (
        scaling.high_freq_factor - scaling.low_freq_factor
    )
    smoothed = (1 - smooth) * scaled / scaling.factor + smooth * scaled
    is_medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return np.where(is_medium, smoothed, scaled)


def rotary_frequencies(
    positions: Int[Array, "*batch seq"],
    *,
    head_dim: int,
    theta: float,
    scaling: RopeScaling | None = None,
) -> tuple[Float[Array, "*batch seq half"], Float[Array, "*batch seq half"]]:
    """cos and sin of position x frequency, in float32, for explicit (possibly ragged) positions."""
    inv_freq = jnp.asarray(inverse_frequencies(head_dim, theta, scaling), jnp.float32)
    angles = positions.astype(jnp.float32)[..., None] * inv_freq
    return jnp.cos(angles), jnp.sin(angles)


def apply_rotary(
    x: Float[Array, "batch seq heads head_dim"],
    cos: Float[Array, "batch seq half"],
    sin: Float[Array, "batch seq half"],
) -> Float[Array, "batch seq heads head_dim"]:
    """Rotate each head vector by its position's angles (float32 math, result in x's dtype)."""
    x32 = x.astype(jnp.float32)
    x1, x2 = jnp.split(x32, 2, axis=-1)
    c, s = cos[:, :, None, :], sin[:, :, None, :]
    return jnp.concatenate([x1 * c - x2 * s, x2 * c + x1 * s], axis=-1).astype(x.dtype)
