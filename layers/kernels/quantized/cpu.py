"""The CPU kernel (matmul.cc) through `jax.ffi`: `cpu_matmul(x, weight)` is `x · W^T` for a
`PackedWeight`, dequantizing in registers, optionally per expert (`group_sizes`).

The library is built by `python -m layers.kernels.quantized.build` (the Makefile's install step
runs it). It is loaded and registered with XLA on first use; a missing library, or one built from
another version of matmul.cc (its source hash is recorded beside it), is an error that says how
to build it.
"""

import ctypes
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, Int

from layers.kernels.quantized.build import LIBRARY, SOURCE, STAMP, source_hash
from layers.quantized.formats import PackedWeight

TARGET = "zoo_quantized_matmul"


class KernelNotBuilt(RuntimeError):
    """The CPU kernel's library is missing or stale."""


@functools.cache
def _registered(digest: str) -> None:
    if not LIBRARY.exists() or not STAMP.exists():
        raise KernelNotBuilt(
            f"the quantized CPU kernel is not built ({LIBRARY} is missing); build it with "
            "`python -m layers.kernels.quantized.build` (make setup runs it)"
        )
    if STAMP.read_text().strip() != digest:
        raise KernelNotBuilt(
            f"{LIBRARY} was built from another version of {SOURCE.name}; rebuild it with "
            "`python -m layers.kernels.quantized.build`"
        )
    library = ctypes.cdll.LoadLibrary(str(LIBRARY))
    jax.ffi.register_ffi_target(TARGET, jax.ffi.pycapsule(library.ZooQuantizedMatmul), "cpu")


def ensure_built() -> None:
    """Load and register the kernel, or raise `KernelNotBuilt` saying how to build it."""
    _registered(source_hash())


def cpu_matmul(
    x: Float[Array, "tokens cols"],
    weight: PackedWeight,
    group_sizes: Int[Array, " experts"] | None = None,
    *,
    portable: bool = False,
) -> Float[Array, "tokens rows"]:
    """`x · W^T` (float32) for `weight` `[rows, cols]`, or with `group_sizes` for an expert-stacked
    `[experts, rows, cols]` weight: rows of x sorted by expert, `group_sizes[e]` of them for
    expert e (rows past their sum give zeros). `portable` runs the kernel's plain C++ path
    instead of its AVX-512 one (a test of both)."""
    # Traced on every backend (jax.lax.platform_dependent traces each branch), lowered only on a
    # CPU: a machine whose programs run elsewhere needs no library.
    if jax.default_backend() == "cpu":
        ensure_built()
    rows, _ = weight.shape
    experts = 0 if group_sizes is None else weight.lead[-1]
    extra = () if group_sizes is None else (group_sizes.astype(jnp.int32),)
    call = jax.ffi.ffi_call(
        TARGET, jax.ShapeDtypeStruct((x.shape[0], rows), jnp.float32), vmap_method="sequential"
    )
    attrs = weight.kernel_attrs()
    return call(
        x.astype(jnp.float32),
        *weight.kernel_arrays(),
        *extra,
        format=weight.kernel_format,
        group=np.int64(weight.group),
        experts=np.int64(experts),
        linear=bool(attrs["linear"]),
        offset=np.float32(attrs["offset"]),
        portable=portable,
    )
