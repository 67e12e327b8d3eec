"""int8 page pools (layers/kernels/paged/int8.py): quantization keeps every number within half
its step; write_pages quantizes each new token on its own and never touches the tokens already
in a page; both paged kernels (the XLA path and the Pallas decode kernel, interpreted on CPU)
read int8 pools as attention over their dequantized values, and stay within a bound derived from
the step sizes of the float pools they were made from.

The pools come from test_paged.build (pages in random pool order, garbage in every slot no row
owns, table entries past a row's pages pointing at another row's page)."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from layers.kernels.paged import Int8Pages, PallasDecodeKernel, paged_attention, write_pages
from layers.kernels.paged.int8 import LEVELS, dequantize, quantize
from layers.paged_cache import POOL_AXES
from tests.layers.test_flash import cuda_mesh
from tests.layers.test_paged import DECODE_CASES, EPS, KERNELS, Case, assert_close, build

# bfloat16 keeps 8 significant bits: rounding moves a number by at most 2^-8 of it.
BF16_ROUNDING = 2.0**-8


def as_int8(pool) -> Int8Pages:
    """A float pool quantized whole (what writing its tokens one by one would store)."""
    values, scales = quantize(pool)
    return Int8Pages(values, scales, POOL_AXES)


def test_quantize_keeps_each_number_within_half_its_step():
    rng = np.random.default_rng(0)
    # Magnitudes from 1e-6 to 1e4 (bfloat16 scales keep float32's exponent range), and zeros.
    x = rng.standard_normal((64, 32)) * 10.0 ** rng.uniform(-6, 4, (64, 1))
    x[3] = 0.0
    numbers, scales = quantize(jnp.asarray(x, jnp.float32))
    assert numbers.dtype == jnp.int8 and scales.dtype == jnp.bfloat16
    step = np.asarray(scales, np.float32)[:, None]
    absmax = np.abs(x).max(axis=-1, keepdims=True)
    # The step is max|x| / 127, rounded to bfloat16.
    assert np.all(np.abs(step - absmax / LEVELS) <= (BF16_ROUNDING + EPS) * absmax / LEVELS)
    err = np.abs(np.asarray(numbers, np.float32) * step - x)
    # Half a step, plus float32's rounding of x / step and of x itself.
    assert np.all(err <= step / 2 + 4 * EPS * absmax)
    assert np.all(np.asarray(numbers)[3] == 0) and float(scales[3]) == 0.0
    assert np.abs(np.asarray(numbers)).max() <= LEVELS


@pytest.mark.parametrize("layer", [None, 1])
def test_write_pages_quantizes_new_tokens_and_leaves_old_ones(layer):
    """Two calls write tokens 0-2 and then 3-4 of one row into the same page: the second call's
    tokens are quantized on their own (a larger key than any before included), the first call's
    numbers and scales are bit for bit what they were."""
    kv, d, page_size, n_pages = 2, 8, 8, 3
    lead = () if layer is None else (2,)
    pool = Int8Pages.zeros((*lead, kv, n_pages, page_size, d), POOL_AXES)
    table = jnp.asarray([[2, 0]], jnp.int32)
    rng = np.random.default_rng(1)
    first = jnp.asarray(rng.standard_normal((3, kv, d)), jnp.float32)
    second = jnp.asarray(100 * rng.standard_normal((2, kv, d)), jnp.float32)
    index = None if layer is None else jnp.asarray(layer)

    def write(pool, new, positions):
        n = new.shape[0]
        groups, valid = jnp.zeros(n, jnp.int32), jnp.ones(n, bool)
        return write_pages(pool, table, groups, jnp.asarray(positions), new, valid, layer=index)

    after_first = write(pool, first, [0, 1, 2])
    after_second = write(after_first, second, [3, 4])
    page = (lambda p: p[:, 2]) if layer is None else (lambda p: p[layer, :, 2])

    def tokens(p, lo, hi):  # [tokens, kv, ...] of page 2
        return np.moveaxis(np.asarray(page(p)[:, lo:hi]), 0, 1)

    for part in ("values", "scales"):
        old = tokens(getattr(after_first, part), 0, 3)
        np.testing.assert_array_equal(tokens(getattr(after_second, part), 0, 3), old)
    for new, lo, hi in ((first, 0, 3), (second, 3, 5)):
        numbers, scales = quantize(new)
        np.testing.assert_array_equal(tokens(after_second.values, lo, hi), np.asarray(numbers))
        np.testing.assert_array_equal(tokens(after_second.scales, lo, hi), np.asarray(scales))
    # Nothing else was written: every other slot is still zero.
    untouched = np.asarray(after_second.values).copy()
    if layer is None:
        untouched[:, 2, :5] = 0
    else:
        untouched[layer, :, 2, :5] = 0
    assert not untouched.any()


def derived_bound(q, spread, k8, v8) -> float:
    """How far attention over int8 pools may be from attention over the float pools they came
    from. A key's numbers are within half its step e_k of the float key, so each scaled score
    moves by at most delta = ||q||_1 max e_k / sqrt(d); softmax weights then change by a factor
    within exp(+-2 delta), so sum_j |p'_j - p_j| <= exp(2 delta) - 1, and since both weight
    vectors sum to 1 the output moves by at most that times half the values' range, plus the
    values' own error, at most max e_v (a convex combination). Maxima over all keys: looser, still
    a bound. `spread`: the values' largest magnitude (>= half any coordinate's range)."""
    d = q.shape[-1]
    half_k = float(jnp.max(k8.scales.astype(jnp.float32))) / 2
    half_v = float(jnp.max(v8.scales.astype(jnp.float32))) / 2
    delta = float(jnp.abs(q).sum(-1).max()) * half_k / math.sqrt(d)
    return (math.exp(2 * delta) - 1) * spread + half_v


def run(kernel, case, q, k_pages, v_pages, table, lengths, q_positions):
    return jax.jit(
        lambda *a: paged_attention(
            *a[:5], q_positions=a[5], sliding_window=case.window, kernel=kernel
        )
    )(q, k_pages, v_pages, table, lengths, q_positions)


@pytest.mark.parametrize(
    ("name", "kernel"),
    [("gqa", "xla"), ("gqa", "pallas-splits"), ("mqa-window-short", "pallas"),
     ("mha-window-page", "xla-blocks"), ("mha-window-page", "pallas-splits")],
)  # fmt: skip
def test_int8_pools_are_attention_over_their_dequantized_values(name, kernel):
    case = DECODE_CASES[name]
    (q, k_pages, v_pages, table, lengths), q_positions, contiguous = build(case)
    k8, v8 = as_int8(k_pages), as_int8(v_pages)
    got = run(KERNELS[kernel], case, q, k8, v8, table, lengths, q_positions)
    over_dequantized = run(
        KERNELS[kernel], case, q, dequantize(k8), dequantize(v8), table, lengths, q_positions
    )
    # The scales folded into scores and weights instead of the keys and values: float32
    # rounding of the same sums (test_paged.assert_close's bound).
    assert_close(got, over_dequantized, case, contiguous[1])
    want = run(KERNELS[kernel], case, q, k_pages, v_pages, table, lengths, q_positions)
    # Over the rows' own keys only: the garbage slots (100x larger) would inflate the bound.
    spread = float(np.abs(contiguous[1]).max())
    k_owned, v_owned = as_int8(jnp.asarray(contiguous[0])), as_int8(jnp.asarray(contiguous[1]))
    bound = derived_bound(q, spread, k_owned, v_owned)
    err = float(jnp.abs(got - want).max())
    assert 0 < err <= bound, f"int8 error {err:.3g} vs derived bound {bound:.3g}"


def test_latent_pool_and_stacked_layer_in_int8():
    """MLA's case (the values are the keys, `v_pages=None`) through a stacked pool's layer
    index, on the XLA path (the only one that reads a stacked pool)."""
    case = Case(lengths=(5, 20, 33), seq=3, kv_heads=1, heads=4)
    (q, k_pages, _, table, lengths), q_positions, contiguous = build(case)
    stacked = jnp.stack([k_pages * 3, k_pages])
    k8 = as_int8(stacked)
    index = jnp.asarray(1)

    def attend(pool):
        return jax.jit(
            lambda q, pool, table, lengths, q_positions: paged_attention(
                q, pool, None, table, lengths, q_positions=q_positions, layer=index
            )
        )(q, pool, table, lengths, q_positions)

    got, over_dequantized = attend(k8), attend(dequantize(k8))
    assert_close(got, over_dequantized, case, contiguous[0])
    owned = as_int8(jnp.asarray(contiguous[0]))
    bound = derived_bound(q, float(np.abs(contiguous[0]).max()), owned, owned)
    err = float(jnp.abs(got - attend(stacked)).max())
    assert 0 < err <= bound, f"int8 error {err:.3g} vs derived bound {bound:.3g}"


def test_int8_pools_pass_the_kernels_checks_and_mixed_pools_are_refused():
    case = DECODE_CASES["gqa"]
    (q, k_pages, v_pages, table, lengths), q_positions, _ = build(case)
    with pytest.raises(ValueError, match="same shape and dtype"):
        paged_attention(q, as_int8(k_pages), v_pages, table, lengths, q_positions=q_positions)


def test_int8_pallas_decode_lowers_for_cuda_through_triton():
    """The real (non-interpret) kernel over int8 pools and their scales, bf16 queries at
    GPU-like sizes, passes Triton's lowering checks without a GPU (no GPU run yet)."""
    b, heads, kv_heads, d, page_size, n_pages, row_pages = 8, 32, 8, 128, 16, 256, 32
    numbers = jax.ShapeDtypeStruct((kv_heads, n_pages, page_size, d), jnp.int8)
    scales = jax.ShapeDtypeStruct((kv_heads, n_pages, page_size), jnp.bfloat16)
    shapes = (
        jax.ShapeDtypeStruct((b, 1, heads, d), jnp.bfloat16),
        numbers,
        scales,
        jax.ShapeDtypeStruct((b, row_pages), jnp.int32),
        jax.ShapeDtypeStruct((b,), jnp.int32),
        jax.ShapeDtypeStruct((b, 1), jnp.int32),
    )

    def step(q, numbers, scales, table, lengths, q_positions):
        pool = Int8Pages(numbers, scales, POOL_AXES)
        return paged_attention(
            q, pool, pool, table, lengths, q_positions=q_positions,
            kernel=PallasDecodeKernel(interpret=False),
        )  # fmt: skip

    with jax.sharding.use_abstract_mesh(cuda_mesh()):
        lowered = jax.jit(step).trace(*shapes).lower(lowering_platforms=("cuda",))
    assert lowered.as_text().count("__gpu$xla.gpu.triton") == 1
