"""`x · W` in float32 for a few tokens on a CPU (dense.cc), what `Linear` runs for decode: XLA's
product of a skinny x packs W's panels first (a second pass over the weight) and reads an
8-row product at about half the rate of the kernel, which reads W once for all the tokens with
its next rows prefetched (bench/RESULTS.md, "A CPU kernel for decode's float32 products").
From 2 to ~100 tokens (an engine step's decode rows and a few prompt chunks) the kernel's walk
is faster than XLA's product, past ~110 XLA's blocked product computes faster (bench/RESULTS.md,
"Prompt chunks with packed weights"); at 1 token (a batch-1 decode step) the kernel reads W in
slices of consecutive rows, one stream per thread, faster than XLA's product in a chain of
dependent products (bench/RESULTS.md, "One token's x · W in slices of rows"). So `x · W` serves
1-96 tokens with AVX-512, 1-48 with AVX2, where XLA's product leads from ~48-64 tokens on a Zen
2 and a Zen 3 (bench/RESULTS.md, "x · W in registers on AVX2", "x · W's range by build").
The tied head multiplies by the embedding table, stored [vocab, embed]: `transposed` walks its
rows in order (`x · W^T`), faster than XLA's product up to 32 tokens (a mixed step's decode rows
and prompt chunks' last tokens).
`KERNEL_TOKENS` holds both ranges for each build the CPU may run (`fastest_walk`); the choice is
made when the program is traced (`uses_dense_kernel`)."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.custom_derivatives import SymbolicZero
from jaxtyping import Array, Float, Int

from layers.kernels.cpu import DENSE_TARGET, WALKS, ensure_built, fastest_walk
from shard.rules import active

# Token counts each walk serves (x · W, x · W^T) by the build the CPU runs, measured against
# XLA's products in RESULTS. No CPU without AVX2 was at hand: the plain C++ build keeps the
# AVX-512 build's ranges, unmeasured.
KERNEL_TOKENS = {
    "avx512": {False: range(1, 97), True: range(2, 33)},
    "avx2": {False: range(1, 49), True: range(2, 33)},
    "portable": {False: range(1, 97), True: range(2, 33)},
}


def dense_matmul(
    x: Float[Array, "tokens k"],
    w: Float[Array, "*layers k n"] | Float[Array, "*layers n k"],
    *,
    transposed: bool = False,
    walk: str = "fastest",
    layer: Int[Array, ""] | None = None,
) -> Float[Array, "tokens n"]:
    """`x · W` (or `x · W^T` when `transposed`, W then [n, k]) in float32 by dense.cc; with
    `layer`, W is a stack `[layers, k, n]` and the kernel reads `W[layer]` where it lies (a
    stacked model's layer loop: slicing it first would copy it every step). Each output
    of `x · W` summed over k in order with one FMA a term (one token's: over each of 4 slices
    of k in order, then the slices' sums in order), of `x · W^T` in 16 lanes (8 with AVX2) then
    across them (XLA sums in other orders: they agree to the float32 rounding of a
    length-k sum).
    `walk`: "fastest" the running CPU's fastest build (AVX-512, else AVX2 with FMA, else plain
    C++); "avx2" the AVX2 one (refused when run on a CPU without AVX2 and FMA) or "portable" the
    plain C++ one, so a test checks each on any CPU. Under vmap the mapped products run one
    after another."""
    if walk not in WALKS:
        raise ValueError(f"dense_matmul walk must be one of {WALKS}, got {walk!r}")
    if w.ndim != (2 if layer is None else 3):
        raise ValueError(
            f"dense_matmul takes W [k, n], or [layers, k, n] with a layer; got {w.shape} and "
            f"layer {'None' if layer is None else 'given'}"
        )
    ensure_built()
    n = w.shape[-2] if transposed else w.shape[-1]
    call = jax.ffi.ffi_call(
        DENSE_TARGET, jax.ShapeDtypeStruct((x.shape[0], n), jnp.float32), vmap_method="sequential"
    )
    return call(
        x.astype(jnp.float32),
        w.astype(jnp.float32),
        jnp.asarray(0 if layer is None else layer, jnp.int32),
        transposed=transposed,
        walk=np.int32(WALKS.index(walk)),
    )


def uses_dense_kernel(tokens: int, *dtypes, transposed: bool = False) -> bool:
    """Whether a product of `tokens` rows runs the kernel: on a CPU, for the token counts
    `KERNEL_TOKENS` gives the walk (`transposed`: by a weight stored [n, k]) in the build the
    CPU runs, in float32 (every dtype given: x's, W's, the compute dtype; a cast of W would
    copy it per call), and outside sharding rules (the kernel has no partitioning rule: a
    sharded product keeps XLA's)."""
    return (
        jax.default_backend() == "cpu"
        and all(jnp.dtype(dtype) == jnp.float32 for dtype in dtypes)
        and active() is None
        and tokens in KERNEL_TOKENS[fastest_walk()][transposed]
    )


@functools.partial(jax.custom_jvp, nondiff_argnums=(2,))
def dense_product(
    x: Float[Array, "tokens k"],
    w: Float[Array, "*layers k n"] | Float[Array, "*layers n k"],
    transposed: bool,
    layer: Int[Array, ""] | None = None,
) -> Float[Array, "tokens n"]:
    """`dense_matmul(x, w, transposed=transposed, layer=layer)`, with derivatives (forward and
    reverse mode) by XLA's products of the tangents, as for `x @ w` (or `x @ w.T`; `w[layer]`
    with a layer)."""
    return dense_matmul(x, w, transposed=transposed, layer=layer)


@functools.partial(dense_product.defjvp, symbolic_zeros=True)
def _dense_jvp(transposed, primals, tangents):
    # A tangent known to be zero (a weight's, outside training) is skipped, as JAX's own
    # derivative of `x @ w` does. Multiplying by the instantiated zeros instead is wasted work,
    # and wrong on XLA:CPU in test_kv_int8's jacfwd over 1,024 directions: all-NaN tangents
    # with this kernel, ~1e36 with a plain `x @ w` under the same rule (fine at 512).
    (x, w, layer), (dx, dw, _) = primals, tangents
    y = dense_product(x, w, transposed, layer)
    dy = jnp.zeros_like(y)
    at = (lambda a: a) if layer is None else (lambda a: a[layer])
    if not isinstance(dx, SymbolicZero):
        dy = dy + dx @ (at(w).T if transposed else at(w))
    if not isinstance(dw, SymbolicZero):
        dy = dy + x @ (at(dw).T if transposed else at(dw))
    return y, dy
