"""Rotary position embeddings (RoFormer, Su et al. 2021) with Llama-3, linear (position
interpolation, Chen et al. 2023; Gemma 3) or YaRN (Peng et al. 2023, arXiv 2309.00071;
DeepSeek-V2/V3) frequency scaling.

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
    """Frequency scaling for a context longer than the one trained, as HF's rope_type says.

    - `kind="llama3"` (Llama-3.1): long wavelengths are divided by `factor`, short ones kept, and
      the band between is interpolated smoothly (`low_freq_factor`, `high_freq_factor`).
    - `kind="linear"`: every frequency divided by `factor`, i.e. positions / factor (HF's
      "linear"; Gemma 3's global layers).
    - `kind="yarn"` (YaRN, Peng et al. 2023, as transformers' `_compute_yarn_parameters`
      computes it with truncation): frequencies that make fewer than `beta_slow` turns over
      `original_max_seq_len` are divided by `factor`, those making more than `beta_fast` kept,
      with a linear ramp between; cos and sin are multiplied by `attention_factor` (the ratio of
      `mscale` terms). DeepSeek's MLA also multiplies its softmax scale by `softmax_mscale()`^2.

    Fields another kind does not use are ignored.
    """

    kind: Literal["llama3", "linear", "yarn"] = "llama3"
    factor: float = 8.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_seq_len: int = 8192
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float = 1.0
    mscale_all_dim: float = 0.0

    def __post_init__(self):
        if self.kind not in ("llama3", "linear", "yarn"):
            raise ValueError(
                f"RopeScaling.kind={self.kind!r} is unknown; choose llama3, linear or yarn"
            )
        if self.factor <= 0:
            raise ValueError(f"RopeScaling.factor must be > 0, got {self.factor}")
        if self.kind == "yarn" and self.beta_fast <= self.beta_slow:
            raise ValueError(
                "RopeScaling.beta_fast must exceed beta_slow for yarn, got "
                f"{self.beta_fast} <= {self.beta_slow}"
            )
        if self.kind == "llama3" and self.high_freq_factor <= self.low_freq_factor:
            raise ValueError(
                "RopeScaling.high_freq_factor must exceed low_freq_factor, got "
                f"{self.high_freq_factor} <= {self.low_freq_factor}"
            )

    @property
    def attention_factor(self) -> float:
        """What YaRN multiplies cos and sin by (1 for llama3)."""
        if self.kind != "yarn":
            return 1.0
        if self.mscale and self.mscale_all_dim:
            return _yarn_mscale(self.factor, self.mscale) / _yarn_mscale(
                self.factor, self.mscale_all_dim
            )
        return _yarn_mscale(self.factor, 1.0)

    def softmax_mscale(self) -> float:
        """DeepSeek's extra softmax factor (its scale is multiplied by the square of this):
        `0.1 mscale_all_dim ln(factor) + 1` under yarn with `mscale_all_dim`, else 1."""
        if self.kind != "yarn" or not self.mscale_all_dim:
            return 1.0
        return _yarn_mscale(self.factor, self.mscale_all_dim)


def _yarn_mscale(scale: float, mscale: float) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _yarn(inv_freq: np.ndarray, head_dim: int, theta: float, s: RopeScaling) -> np.ndarray:
    """YaRN's blend of interpolated (divided by `factor`) and extrapolated (kept) frequencies,
    the correction range truncated to whole dims as transformers does by default."""

    def dim_of(turns: float) -> float:  # the dim that makes `turns` turns over the context
        return (
            head_dim
            * math.log(s.original_max_seq_len / (turns * 2 * math.pi))
            / (2 * math.log(theta))
        )

    low = max(math.floor(dim_of(s.beta_fast)), 0)
    high = min(math.ceil(dim_of(s.beta_slow)), head_dim - 1)
    high = high + 0.001 if low == high else high  # transformers' guard against 0/0
    # transformers computes the ramp in float32; it is exact here for these small integers.
    ramp = np.clip((np.arange(head_dim // 2, dtype=np.float64) - low) / (high - low), 0, 1)
    extrapolate = 1 - ramp
    return inv_freq / s.factor * (1 - extrapolate) + inv_freq * extrapolate


def inverse_frequencies(head_dim: int, theta: float, scaling: RopeScaling | None) -> np.ndarray:
    """The `head_dim / 2` angular frequencies theta^(-2i/head_dim), optionally scaled
    (`RopeScaling`). Computed with NumPy in float64: they are constants of the traced program."""
    inv_freq = 1.0 / theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    if scaling is None:
        return inv_freq
    if scaling.kind == "linear":
        return inv_freq / scaling.factor
    if scaling.kind == "yarn":
        return _yarn(inv_freq, head_dim, theta, scaling)
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
    """cos and sin of position x frequency, in float32, for explicit (possibly ragged) positions
    (both times YaRN's `attention_factor` under yarn scaling, as transformers applies it)."""
    inv_freq = jnp.asarray(inverse_frequencies(head_dim, theta, scaling), jnp.float32)
    angles = positions.astype(jnp.float32)[..., None] * inv_freq
    factor = 1.0 if scaling is None else scaling.attention_factor
    if factor == 1.0:
        return jnp.cos(angles), jnp.sin(angles)
    return jnp.cos(angles) * factor, jnp.sin(angles) * factor


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
