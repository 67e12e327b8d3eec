"""The float32 CPU kernel for products of a few tokens (layers/kernels/cpu/dense.cc): equal to the
exact product within the float32 bound of a length-k sum, on each of its builds (the CPU's
fastest, AVX2, plain C++; a CPU without AVX2 refuses that one), for every token count and for
widths that end inside a panel; `Linear` runs it exactly where
`uses_dense_kernel` says (float32 tokens on a CPU in the running build's range, 1-96 with AVX-512
and 1-48 with AVX2, 2-32 for the tied head, no sharding rules), and its derivatives in both
modes, under vmap, are XLA's.

Tolerance: any order of summing k float32 products (the kernel's FMAs in k order, XLA's blocked
sums) errs from the exact sum by at most gamma_k * sum_i |x_i w_i|, gamma_k = k u / (1 - k u),
u = 2^-24 (Higham, Accuracy and Stability of Numerical Algorithms, 2nd ed., eq. 3.5)."""

from pathlib import Path

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import shard
from layers import Embedding, Linear
from layers.kernels.cpu import DENSE_TARGET, fastest_walk
from layers.kernels.cpu.dense import KERNEL_TOKENS, WALKS, dense_matmul, uses_dense_kernel

U = 2.0**-24


def bound(x, w):
    """gamma_k * (|x| @ |w|), elementwise, in float64."""
    k = x.shape[-1]
    x, w = np.abs(np.asarray(x, np.float64)), np.abs(np.asarray(w, np.float64))
    return k * U / (1 - k * U) * (x @ w)


def assert_within_bound(got, x, w, *, added=None):
    """`got` is x @ w within the bound; with `added` (a bias), `got` is fl(x @ w + added)
    compared after taking `added` away in float64: one more rounding, u |got|."""
    exact = np.asarray(x, np.float64) @ np.asarray(w, np.float64)
    got = np.asarray(got, np.float64)
    limit = bound(x, w)
    if added is not None:
        got, limit = got - np.asarray(added, np.float64), limit + U * np.abs(got)
    err = np.abs(got - exact)
    assert (err <= limit).all(), float((err / limit).max())


def cpu_has_avx2_fma() -> bool:
    """The running CPU's flags (Linux's /proc/cpuinfo) name AVX2 and FMA."""
    cpuinfo = Path("/proc/cpuinfo")
    flags = set(cpuinfo.read_text().split()) if cpuinfo.exists() else set()
    return {"avx2", "fma"} <= flags


# Widths: one vector, a panel and a bit (masked tail), several panels, and more than one of the
# AVX2 walk's 192-column tiles in a work item (its columns past a 24-column panel, or no whole
# panel); k: odd, long, past a 16-row block and groups of 4 rows. Transposed
# (W stored [n, k], the tied head's walk): k's 16-lane tail masked, n's last rows past a group
# of 4.
@pytest.mark.parametrize("k, n", [(5, 16), (33, 50), (96, 100), (257, 201), (7, 1100)])
@pytest.mark.parametrize("walk", WALKS)
@pytest.mark.parametrize("transposed", [False, True], ids=["x.w", "x.wT"])
def test_the_kernel_is_the_product_within_the_float32_bound(k, n, walk, transposed):
    w = jax.random.normal(jax.random.key(0), (k, n))
    stored = w.T if transposed else w
    product = jax.jit(lambda x, w: dense_matmul(x, w, transposed=transposed, walk=walk))
    if walk == "avx2" and not cpu_has_avx2_fma():
        with pytest.raises(Exception, match="needs a CPU with AVX2 and FMA"):
            product(jnp.ones((2, k)), stored).block_until_ready()
        return
    for tokens in (1, 2, 3, 4, 5, 7, 8, 13, 16):  # every tile (8, 4, 2, 1 tokens), remainders
        x = jax.random.normal(jax.random.key(tokens), (tokens, k))
        got = product(x, stored)
        assert got.shape == (tokens, n)
        assert_within_bound(got, x, w)


@pytest.mark.parametrize("tokens", [1, 3, 16])
@pytest.mark.parametrize("transposed", [False, True], ids=["x.w", "x.wT"])
def test_a_layer_of_a_stack_is_read_where_it_lies(tokens, transposed):
    # A stacked model's layer loop (`Linear.at_layer`): the kernel reads W[layer] in place, the
    # same walk over the same floats as on the layer's own copy: bit for bit its product.
    stack = jax.random.normal(jax.random.key(0), (3, 33, 50))
    x = jax.random.normal(jax.random.key(1), (tokens, 50 if transposed else 33))
    read = jax.jit(lambda x, w, i: dense_matmul(x, w, transposed=transposed, layer=i))
    copy = jax.jit(lambda x, w: dense_matmul(x, w, transposed=transposed))
    for i in range(3):
        np.testing.assert_array_equal(read(x, stack, jnp.int32(i)), copy(x, stack[i]))
    with pytest.raises(Exception, match="layer out of range"):
        read(x, stack, jnp.int32(3)).block_until_ready()
    with pytest.raises(ValueError, match=r"W \[k, n\], or \[layers, k, n\] with a layer"):
        dense_matmul(x, stack, transposed=transposed)


def test_a_linear_reading_a_layer_computes_what_its_slice_does():
    # Within the kernel's token range (the kernel, in place) and past it (XLA's einsum on the
    # slice), with the bias sliced.
    keys = jax.random.split(jax.random.key(0), 3)
    stacked = eqx.filter_vmap(
        lambda k: Linear(40, (2, 8), axes=("embed", "heads", "head_dim"), use_bias=True, key=k)
    )(keys)
    stacked = eqx.tree_at(
        lambda s: s.bias, stacked, jax.random.normal(jax.random.key(2), (3, 2, 8))
    )
    for tokens in (1, 4, 200):
        x = jax.random.normal(jax.random.key(tokens), (tokens, 40))
        for i in range(3):
            got = jax.jit(lambda x, s, i: s.at_layer(i)(x))(x, stacked, jnp.int32(i))
            want = jax.jit(lambda x, s: s(x))(x, jax.tree.map(lambda a, i=i: a[i], stacked))
            np.testing.assert_array_equal(got, want)


def test_an_unknown_walk_is_refused():
    with pytest.raises(ValueError, match="walk must be one of"):
        dense_matmul(jnp.ones((2, 4)), jnp.ones((4, 3)), walk="avx512")


@pytest.mark.parametrize("transposed", [False, True], ids=["x.w", "x.wT"])
def test_a_product_large_enough_to_be_threaded_is_within_the_bound(transposed):
    """2^21 multiply-adds and more are split over XLA's thread pool by panels; one token's x · W
    from 2^16 weights by slices of W's rows (k = 771 cuts into slices of 192 and 193 rows, each
    past a group of 4)."""
    for tokens in (8, 1):
        x = jax.random.normal(jax.random.key(1), (tokens, 771))
        w = jax.random.normal(jax.random.key(2), (771, 1001))
        got = jax.jit(lambda x, w: dense_matmul(x, w, transposed=transposed))(
            x, w.T if transposed else w
        )
        assert_within_bound(got, x, w)


LINEAR = Linear((6,), (2, 5), axes=("embed", "heads", "head_dim"), use_bias=True,
                key=jax.random.key(0))  # fmt: skip
LINEAR = eqx.tree_at(lambda m: m.bias, LINEAR, jnp.arange(10.0).reshape(2, 5))


def calls_kernel(call, x) -> bool:
    text = jax.jit(lambda x: call(x)).lower(x).as_text()
    return DENSE_TARGET in text


# The most tokens `x · W` runs the kernel for in the build this CPU runs (96 AVX-512, 48 AVX2).
MOST = KERNEL_TOKENS[fastest_walk()][False][-1]


def test_the_ranges_are_the_build_the_cpu_runs():
    """The library reports the build its CPU check picks; Linux's flags say which it must be."""
    flags = set()
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("flags"):
            flags = set(line.split(":", 1)[1].split())
            break
    expected = "avx2" if {"avx2", "fma"} <= flags else "portable"
    assert fastest_walk() == ("avx512" if {"avx512f", "fma"} <= flags else expected)
    assert KERNEL_TOKENS[fastest_walk()][False] == range(1, MOST + 1)


@pytest.mark.parametrize(
    "shape, kernel",
    [((1, 1, 6), True), ((1, 2, 6), True), ((4, 6), True), ((2, 8, 6), True),
     ((2, MOST // 2, 6), True), ((MOST + 1, 6), False)],
)  # fmt: skip
def test_linear_takes_the_kernel_for_the_builds_float32_tokens(shape, kernel):
    x = jax.random.normal(jax.random.key(1), shape)
    assert calls_kernel(LINEAR, x) is kernel
    y = eqx.filter_jit(lambda m, x: m(x))(LINEAR, x)
    flat, bias = np.asarray(y).reshape(-1, 10), np.asarray(LINEAR.bias).reshape(10)
    assert_within_bound(
        flat, np.asarray(x).reshape(-1, 6), LINEAR.weight.reshape(6, 10), added=bias
    )


@pytest.mark.parametrize("tokens, kernel", [(1, False), (2, True), (32, True), (33, False)])
def test_the_tied_head_takes_the_kernel_for_two_to_thirty_two_float32_tokens(tokens, kernel):
    embedding = Embedding(50, 6, key=jax.random.key(0))
    x = jax.random.normal(jax.random.key(1), (1, tokens, 6))
    assert calls_kernel(embedding.unembed, x) is kernel
    got = jax.jit(lambda m, x: m.unembed(x))(embedding, x)
    assert got.shape == (1, tokens, 50)
    assert_within_bound(got[0], x[0], embedding.weight.T)
    # Its derivatives: the table's gradient (x^T c, as rows) and jacfwd, both XLA's products.
    c = jax.random.normal(jax.random.key(2), (1, tokens, 50))
    grad = jax.grad(lambda w: (c * Embedding.of(w).unembed(x)).sum())(embedding.weight)
    assert_within_bound(grad.T, x[0].T, c[0])
    np.testing.assert_array_equal(
        jax.jacfwd(embedding.unembed)(x), jax.jacfwd(lambda x: x @ embedding.weight.T)(x)
    )


def test_other_dtypes_and_sharding_rules_keep_xla():
    x = jax.random.normal(jax.random.key(1), (4, 6))
    assert not calls_kernel(LINEAR, x.astype(jnp.bfloat16))
    assert not uses_dense_kernel(4, jnp.float32, jnp.bfloat16)  # a bf16 weight: no copy per call
    mesh = shard.mesh(data=8)
    with shard.rules.use_rules(shard.ShardingRules.preset("dp"), mesh):
        assert not calls_kernel(LINEAR, x)
    assert calls_kernel(LINEAR, x)


def test_derivatives_in_both_modes_and_vmap():
    """Reverse mode (training) gives the exact gradients of a linear loss sum(c * y) within the
    bound of their sums (dW = x^T c over the tokens, dx = c W^T over the outputs); forward mode
    (tests/infer/test_kv_int8.py's sensitivity) gives the einsum's Jacobian; vmap maps the
    kernel."""
    x = jax.random.normal(jax.random.key(3), (4, 6))
    c = jax.random.normal(jax.random.key(5), (4, 2, 5))
    w = LINEAR.weight

    def linear(w, x):
        return eqx.tree_at(lambda m: m.weight, LINEAR, w)(x)

    assert calls_kernel(LINEAR, x)
    dw, dx = jax.grad(lambda w, x: (c * linear(w, x)).sum(), (0, 1))(w, x)
    flat_c = np.asarray(c).reshape(4, 10)
    assert_within_bound(np.asarray(dw).reshape(6, 10), np.asarray(x).T, flat_c)
    assert_within_bound(dx, flat_c, np.asarray(w).reshape(6, 10).T)
    got = jax.jacfwd(lambda x: linear(w, x))(x)
    want = jax.jacfwd(lambda x: jnp.einsum("ta,abc->tbc", x, w) + LINEAR.bias)(x)
    np.testing.assert_array_equal(got, want)  # the tangent of x @ W is dx @ W: XLA's both ways
    batched = jax.random.normal(jax.random.key(4), (3, 4, 6))
    mapped = jax.vmap(lambda x: linear(w, x))(batched)
    for i in range(3):
        flat = np.asarray(mapped[i]).reshape(4, 10)
        assert_within_bound(flat, batched[i], w.reshape(6, 10), added=LINEAR.bias.reshape(10))
