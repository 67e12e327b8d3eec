"""`x · W` in float32 for a few tokens on a CPU (dense.cc), what `Linear` runs for decode: XLA's
product of a skinny x packs W's panels first (a second pass over the weight) and reads an
8-row product at about half the rate of the kernel, which reads W once for all the tokens with
its next rows prefetched (bench/RESULTS.md, "skinny products"). At 1 row XLA's own product
streams faster, and past 8 tokens the kernel would walk W once per 8, so it serves 2-8 tokens
(`DENSE_KERNEL_TOKENS`). The choice is made when the program is traced (`uses_dense_kernel`)."""

import functools

import jax
import jax.numpy as jnp
from jax.custom_derivatives import SymbolicZero
from jaxtyping import Array, Float

from layers.kernels.cpu import DENSE_TARGET, ensure_built
from shard.rules import active

DENSE_KERNEL_TOKENS = range(2, 9)


def dense_matmul(
    x: Float[Array, "tokens k"], w: Float[Array, "k n"], *, portable: bool = False
) -> Float[Array, "tokens n"]:
    """`x · W` in float32 by dense.cc, each output summed over k in order with one FMA a term
    (XLA sums in another order: the two agree to the float32 rounding of a length-k sum).
    `portable`: the plain C++ path instead of the AVX-512 one (a test of both). Under vmap the
    mapped products run one after another."""
    ensure_built()
    call = jax.ffi.ffi_call(
        DENSE_TARGET, jax.ShapeDtypeStruct((x.shape[0], w.shape[1]), jnp.float32),
        vmap_method="sequential",
    )  # fmt: skip
    return call(x.astype(jnp.float32), w.astype(jnp.float32), portable=portable)


def uses_dense_kernel(tokens: int, *dtypes) -> bool:
    """Whether a product of `tokens` rows runs the kernel: on a CPU, for 2-8 tokens, in float32
    (every dtype given: x's, W's, the compute dtype; a cast of W would copy it per call), and
    outside sharding rules (the kernel has no partitioning rule: a sharded product keeps
    XLA's)."""
    return (
        jax.default_backend() == "cpu"
        and tokens in DENSE_KERNEL_TOKENS
        and all(jnp.dtype(dtype) == jnp.float32 for dtype in dtypes)
        and active() is None
    )


@jax.custom_jvp
def dense_product(x: Float[Array, "tokens k"], w: Float[Array, "k n"]) -> Float[Array, "tokens n"]:
    """`dense_matmul(x, w)`, with derivatives (forward and reverse mode) by XLA's products of
    the tangents, as for `x @ w`."""
    return dense_matmul(x, w)


@functools.partial(dense_product.defjvp, symbolic_zeros=True)
def _dense_jvp(primals, tangents):
    # A tangent known to be zero (a weight's, outside training) is skipped, as JAX's own
    # derivative of `x @ w` does. Multiplying by the instantiated zeros instead is wasted work,
    # and wrong on XLA:CPU in test_kv_int8's jacfwd over 1,024 directions: all-NaN tangents
    # with this kernel, ~1e36 with a plain `x @ w` under the same rule (fine at 512).
    (x, w), (dx, dw) = primals, tangents
    y = dense_product(x, w)
    dy = jnp.zeros_like(y)
    if not isinstance(dx, SymbolicZero):
        dy = dy + dx @ w
    if not isinstance(dw, SymbolicZero):
        dy = dy + x @ dw
    return y, dy
