"""Block sizes and launch settings of the flash kernel, and the checks on its inputs.

Every check raises a ValueError that names the offending size or dtype and says what to change:
the kernel never falls back to another implementation.
"""

import dataclasses
from typing import Literal

import jax.numpy as jnp

SUPPORTED_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
# Triton tiles must be powers of two, and its matmul needs every side >= 16.
SUPPORTED_HEAD_DIMS = (16, 32, 64, 128, 256)
MIN_BLOCK = 16


def _is_power_of_two(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


@dataclasses.dataclass(frozen=True, kw_only=True)
class BlockSizes:
    """Tile sizes (powers of two, >= 16), Triton launch settings and how the backward sums dQ.

    `block_q` x `block_k` is the forward tile: one program owns `block_q` query rows and walks the
    keys `block_k` at a time. `backward_block_q` / `backward_block_k` tile the backward (one
    program per key block walks the query blocks; with `backward_dq="separate"` also one program
    per query block). A block longer than the sequence is clipped to the sequence.
    `num_warps`: Triton warps per program, forward and backward (4 measured faster than 8 at
    head_dim 64 and 128 on an H100, bench/RESULTS.md).

    `backward_dq` (see backward.py): "atomic" adds each tile's dQ into a float32 buffer with atomic
    adds inside the dK/dV kernel (FlashAttention-2's 5 matmuls per tile pair; on a GPU the order
    of the additions, so dQ's last bits, vary from run to run); "separate" runs a second kernel
    that recomputes S and dP (7 matmuls) and is bit-reproducible. "separate" is the default: the
    atomic adds contend on the same dQ tiles, and on an H100 the separate kernel measured faster
    (bench/RESULTS.md, flash block sweep).
    """

    block_q: int = 128
    block_k: int = 64
    backward_block_q: int = 64
    backward_block_k: int = 64
    num_warps: int = 4
    num_stages: int = 2
    backward_dq: Literal["atomic", "separate"] = "separate"

    def __post_init__(self):
        for field in ("block_q", "block_k", "backward_block_q", "backward_block_k"):
            value = getattr(self, field)
            if not (_is_power_of_two(value) and value >= MIN_BLOCK):
                raise ValueError(
                    f"BlockSizes.{field}={value} must be a power of two >= {MIN_BLOCK} "
                    "(Triton tiles are powers of two and its matmul needs sides >= 16)"
                )
        if self.backward_dq not in ("atomic", "separate"):
            raise ValueError(
                f"BlockSizes.backward_dq={self.backward_dq!r} must be 'atomic' (5 matmuls per "
                "tile pair, dQ not bit-reproducible on a GPU) or 'separate' (7, bit-reproducible)"
            )

    @property
    def backward_kernels(self) -> int:
        """Pallas calls of the backward: dK/dV(/dQ), plus dQ's own when "separate"."""
        return 1 if self.backward_dq == "atomic" else 2


DEFAULT_BLOCK_SIZES = BlockSizes()


def fit_block(block: int, length: int, *, name: str, field: str) -> int:
    """The tile actually used along a sequence of `length`: `block`, clipped to the sequence."""
    used = min(block, length)
    if _is_power_of_two(used) and used >= MIN_BLOCK and length % used == 0:
        return used
    if length >= block:
        padded = -(-length // block) * block
        raise ValueError(
            f"flash attention: {name} length {length} is not a multiple of BlockSizes.{field}="
            f"{block}; pad the sequence to {padded} or choose a {field} that divides {length}"
        )
    padded = max(MIN_BLOCK, 1 << (length - 1).bit_length())
    raise ValueError(
        f"flash attention: {name} length {length} is shorter than BlockSizes.{field}={block} "
        f"and not a power of two >= {MIN_BLOCK}; pad the sequence to {padded}"
    )


def check_inputs(q_shape, k_shape, v_shape, q_dtype, k_dtype, v_dtype) -> None:
    """Shapes and dtypes the kernel supports; anything else is a ValueError saying what to do."""
    *_, n_heads, head_dim = q_shape
    if k_shape != v_shape:
        raise ValueError(f"flash attention: k {k_shape} and v {v_shape} must have the same shape")
    if k_shape[-1] != head_dim:
        raise ValueError(
            f"flash attention: q head_dim {head_dim} differs from k/v head_dim {k_shape[-1]}"
        )
    if head_dim not in SUPPORTED_HEAD_DIMS:
        raise ValueError(
            f"flash attention: head_dim={head_dim} is not supported; use one of "
            f"{SUPPORTED_HEAD_DIMS} (Triton tiles are powers of two >= 16) or attention='xla'"
        )
    if n_heads % k_shape[2] != 0:
        raise ValueError(
            f"flash attention: heads={n_heads} must be a multiple of kv_heads={k_shape[2]}"
        )
    if not (jnp.dtype(q_dtype) == jnp.dtype(k_dtype) == jnp.dtype(v_dtype)):
        raise ValueError(
            f"flash attention: q, k, v dtypes differ ({q_dtype}, {k_dtype}, {v_dtype}); "
            "cast them to one dtype"
        )
    if jnp.dtype(q_dtype) not in SUPPORTED_DTYPES:
        raise ValueError(
            f"flash attention: dtype {q_dtype} is not supported; use one of "
            f"{[d.name for d in SUPPORTED_DTYPES]}"
        )


@dataclasses.dataclass(frozen=True, kw_only=True)
class Plan:
    """Everything static about one call: the mask rule, the fitted tiles and how to launch."""

    causal: bool
    windowed: bool  # the window itself is data: an input of the kernels (a per-layer value)
    softcap: float | None  # scores -> softcap * tanh(scale * s / softcap) (Gemma 2)
    scale: float
    group: int  # query heads per K/V head
    block_q: int
    block_k: int
    backward_block_q: int
    backward_block_k: int
    num_warps: int
    num_stages: int
    backward_dq: Literal["atomic", "separate"]
    interpret: bool
