"""Paged attention: every kernel (the XLA path over the blocks of pages, the Pallas decode kernel
interpreted on CPU, the C++ decode kernel) equals naive attention over the equivalent contiguous
cache, also through a leading stacked-layers axis; a CPU's default decode kernel is the C++ one
exactly where it serves the call, its derivative the XLA path's; the XLA path reads only the
blocks that hold visible keys; write_pages scatters in place; bad inputs are refused; the Pallas
kernel lowers for CUDA at GPU-like sizes.

Pools are built from a contiguous cache by hand (numpy, pages in random pool order), every pool
slot that no row owns holds large garbage, and table entries past a row's last page point at
page 0 (another row's page), so reading a wrong page or an unmasked slot changes the answer."""

import collections
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import shard
from layers.kernels import AttentionMask, naive_attention
from layers.kernels.paged import (
    CpuDecodeKernel,
    Int8Pages,
    PallasDecodeKernel,
    XlaPagedKernel,
    check_page_table,
    paged_attention,
    write_pages,
)
from layers.kernels.paged.attention import (
    CPU_BLOCK_FLOATS,
    default_decode_kernel,
    keys_per_block_for,
)
from tests.layers.test_dense_kernel import cpu_has_avx2_fma
from tests.layers.test_flash import cuda_mesh

EPS = float(np.finfo(np.float32).eps)


@dataclasses.dataclass(frozen=True)
class Case:
    lengths: tuple[int, ...]
    page_size: int = 16
    heads: int = 4
    kv_heads: int = 2
    head_dim: int = 16
    row_pages: int = 4
    seq: int = 1  # query tokens per row, at positions lengths - seq .. lengths - 1
    window: int | None = None


def build(case: Case, seed: int = 0):
    """q, the pools, the page table and the contiguous cache holding the same keys/values."""
    rng = np.random.default_rng(seed)
    b, p, kv, d = len(case.lengths), case.page_size, case.kv_heads, case.head_dim
    capacity = case.row_pages * p
    k = rng.standard_normal((b, capacity, kv, d), np.float32)
    v = rng.standard_normal((b, capacity, kv, d), np.float32)
    used = [-(-n // p) for n in case.lengths]
    n_pages = sum(used) + 3  # a few free pages
    k_pages = 100 * rng.standard_normal((kv, n_pages, p, d), np.float32)  # garbage
    v_pages = 100 * rng.standard_normal((kv, n_pages, p, d), np.float32)
    table = np.zeros((b, case.row_pages), np.int32)  # unused entries: page 0
    order = iter(rng.permutation(n_pages))
    for row, n in enumerate(case.lengths):
        for i in range(used[row]):
            page = next(order)
            table[row, i] = page
            held = min(p, n - i * p)  # the slots past the row's length keep their garbage
            k_pages[:, page, :held] = k[row, i * p : i * p + held].transpose(1, 0, 2)
            v_pages[:, page, :held] = v[row, i * p : i * p + held].transpose(1, 0, 2)
    q = rng.standard_normal((b, case.seq, case.heads, d), np.float32)
    lengths = np.asarray(case.lengths, np.int32)
    q_positions = np.maximum(lengths[:, None] - case.seq + np.arange(case.seq), 0)
    paged = (q, k_pages, v_pages, table, lengths)
    return tuple(map(jnp.asarray, paged)), jnp.asarray(q_positions, jnp.int32), (k, v)


def reference(case: Case, q, q_positions, contiguous):
    """naive_attention over the contiguous cache; a key past a row's length has segment 0."""
    k, v = contiguous
    b, capacity = k.shape[:2]
    kv_positions = jnp.broadcast_to(jnp.arange(capacity), (b, capacity))
    mask = AttentionMask(
        q_positions=q_positions,
        kv_positions=kv_positions,
        q_segment_ids=jnp.ones(q_positions.shape, jnp.int32),
        kv_segment_ids=(kv_positions < jnp.asarray(case.lengths)[:, None]).astype(jnp.int32),
        sliding_window=case.window,
    )
    return naive_attention(q, jnp.asarray(k), jnp.asarray(v), mask)


def assert_close(got, want, case: Case, v):
    """float32 rounding bound: each output is a softmax-weighted sum of up to `capacity` values
    after scores that are `head_dim`-term dot products, so the error is at most about
    (head_dim + capacity) roundings of the largest value (Higham 2002, 3.1)."""
    capacity = case.row_pages * case.page_size
    bound = (case.head_dim + capacity) * EPS * float(np.abs(v).max())
    err = float(np.abs(np.asarray(got) - np.asarray(want)).max())
    assert err <= bound, f"max error {err:.3g} > bound {bound:.3g}"


KERNELS = {
    "xla": XlaPagedKernel(),
    "xla-blocks": XlaPagedKernel(keys_per_block=16),
    "pallas": PallasDecodeKernel(keys_per_block=16, splits=1),
    "pallas-splits": PallasDecodeKernel(keys_per_block=32, splits=3),
    "cpu": CpuDecodeKernel(),
    "cpu-portable": CpuDecodeKernel(walk="portable"),
}
# The C++ kernel's AVX2 walk runs where the CPU has AVX2 and FMA (every machine of ours); a CPU
# without them refuses it (test_a_cpu_without_avx2_refuses_its_walk).
if cpu_has_avx2_fma():
    KERNELS["cpu-avx2"] = CpuDecodeKernel(walk="avx2")
CPU_WALKS = [name for name in KERNELS if name.startswith("cpu")]

# One token, a partial last page, exactly full pages, and a long row; GQA and MQA; windows
# shorter and longer than the context.
DECODE_CASES = {
    "gqa": Case(lengths=(1, 13, 32, 53)),
    "mqa-window-short": Case(lengths=(1, 13, 32, 53), kv_heads=1, window=5),
    "gqa-window-long": Case(lengths=(2, 17, 48), window=1000),
    "mha-window-page": Case(lengths=(40, 64, 9), heads=2, window=16, page_size=8, row_pages=8),
}


def run(kernel, case, paged, q_positions):
    return jax.jit(
        lambda *a: paged_attention(
            *a[:5], q_positions=a[5], sliding_window=case.window, kernel=kernel
        )
    )(*paged, q_positions)


@pytest.mark.parametrize("kernel", list(KERNELS))
@pytest.mark.parametrize("name", list(DECODE_CASES))
def test_decode_equals_naive_over_contiguous_cache(name, kernel):
    case = DECODE_CASES[name]
    paged, q_positions, contiguous = build(case)
    got = run(KERNELS[kernel], case, paged, q_positions)
    assert got.shape == paged[0].shape
    assert_close(got, reference(case, paged[0], q_positions, contiguous), case, contiguous[1])


@pytest.mark.parametrize("kernel", ["xla-blocks", "pallas-splits", *CPU_WALKS])
def test_queries_away_from_the_end_see_only_held_earlier_keys(kernel):
    """A query at position i < length - 1 (later keys already written) sees keys <= i; one at
    i >= length (its own key not written yet) sees the row's keys only, not the slots after."""
    case = Case(lengths=(30, 50, 20), window=20)
    paged, _, contiguous = build(case, seed=1)
    q_positions = jnp.array([[3], [41], [25]], jnp.int32)
    got = run(KERNELS[kernel], case, paged, q_positions)
    assert_close(got, reference(case, paged[0], q_positions, contiguous), case, contiguous[1])


@pytest.mark.parametrize("keys_per_block", [16, 256])
@pytest.mark.parametrize("window", [None, 7])
def test_prefill_chunk_through_the_xla_path_equals_naive(window, keys_per_block):
    """seq > 1: a chunk of queries attends causally over pages that already hold it."""
    case = Case(lengths=(5, 16, 37), seq=5, window=window)
    paged, q_positions, contiguous = build(case, seed=2)
    got = run(XlaPagedKernel(keys_per_block=keys_per_block), case, paged, q_positions)
    assert_close(got, reference(case, paged[0], q_positions, contiguous), case, contiguous[1])


@pytest.mark.parametrize("kernel", CPU_WALKS)
@pytest.mark.parametrize("window", [None, 7])
def test_prefill_chunk_through_the_cpp_kernel_equals_naive_and_its_decode_steps(window, kernel):
    """seq > 1 through the C++ kernel: each query token is its own item, so a chunk's token gets
    the bits a decode step of that token alone gets (the engine's tokens do not depend on what
    else its steps hold)."""
    case = Case(lengths=(5, 16, 37), seq=5, window=window)
    paged, q_positions, contiguous = build(case, seed=2)
    got = run(KERNELS[kernel], case, paged, q_positions)
    assert_close(got, reference(case, paged[0], q_positions, contiguous), case, contiguous[1])
    q, *pools = paged
    for i in range(case.seq):
        alone = run(KERNELS[kernel], case, (q[:, i : i + 1], *pools), q_positions[:, i : i + 1])
        np.testing.assert_array_equal(np.asarray(alone[:, 0]), np.asarray(got[:, i]))


@pytest.mark.parametrize("kernel", ["xla-blocks", "cpu"])
def test_a_stacked_layer_is_read_through_its_index(kernel):
    """Pools with a leading layers axis: `layer` picks one, as if it were the only pool."""
    case = Case(lengths=(5, 30, 17), window=12)
    paged, q_positions, contiguous = build(case, seed=7)
    q, k_pages, v_pages, table, lengths = paged
    noise = 1e3 * jnp.ones_like(k_pages)
    stacked = [jnp.stack([noise, pool, noise]) for pool in (k_pages, v_pages)]
    got = jax.jit(
        lambda *a: paged_attention(
            *a, q_positions=q_positions, sliding_window=case.window,
            kernel=KERNELS[kernel], layer=jnp.int32(1),
        )
    )(q, *stacked, table, lengths)  # fmt: skip
    assert_close(got, reference(case, q, q_positions, contiguous), case, contiguous[1])


def test_the_xla_path_reads_only_the_blocks_that_hold_visible_keys():
    """Rows of 40 and 44 tokens, a window of 8: every visible key is in each row's third page
    (positions 32-47), so the walk reads that block alone; every other page holds NaN keys and
    values, and reading one would poison the output (0 x NaN is NaN)."""
    case = Case(lengths=(40, 44), window=8, row_pages=8)
    paged, q_positions, contiguous = build(case, seed=8)
    q, k_pages, v_pages, table, lengths = paged
    keep = {int(table[0, 2]), int(table[1, 2])}
    poisoned = []
    for pool in (k_pages, v_pages):
        pool = np.asarray(pool).copy()
        pool[:, [p for p in range(pool.shape[1]) if p not in keep]] = np.nan
        poisoned.append(jnp.asarray(pool))
    got = run(XlaPagedKernel(keys_per_block=16), case, (q, *poisoned, table, lengths), q_positions)
    assert_close(got, reference(case, q, q_positions, contiguous), case, contiguous[1])


def test_a_cpu_decodes_through_the_cpp_kernel_where_it_serves_the_call():
    """Float32 query tokens (one per row, or a prompt chunk's), no sharding rules: the C++
    kernel; bfloat16 or int8 pools, or a mesh's rules: the XLA path.
    Chosen explicitly where it cannot serve, it is refused with the reason."""
    (q, k_pages, _, _, _), _ = inputs()
    assert default_decode_kernel(q, k_pages, None) == CpuDecodeKernel()
    bf16, _ = inputs(dtype=jnp.bfloat16)
    int8 = Int8Pages.zeros(k_pages.shape, ("kv_heads", "pages", "page_size", "head_dim"))
    for q_, pool in [(bf16[0], bf16[1]), (q, int8)]:
        assert default_decode_kernel(q_, pool, None) == XlaPagedKernel()
    with shard.rules.use_rules(shard.ShardingRules.preset("dp"), shard.mesh(data=8)):
        assert default_decode_kernel(q, k_pages, None) == XlaPagedKernel()
    args, q_positions = inputs(dtype=jnp.bfloat16)
    with pytest.raises(ValueError, match="needs float32 q and pools, got q bfloat16"):
        paged_attention(*args, q_positions=q_positions, kernel=CpuDecodeKernel())
    args, q_positions = inputs(t=4)  # a prompt chunk: the C++ kernel too
    assert default_decode_kernel(args[0], args[1], None) == CpuDecodeKernel()


# The C++ kernel's vector path at its edges: a head_dim that is not a multiple of 16 (a masked
# last vector), more than 4 query heads per K/V head (two groups of heads take the values), pages
# of more than 16 keys (two blocks of scores) or fewer, rows starting and ending mid-page.
CPP_EDGE_CASES = {
    "dim-24-group-5-pages-of-32": Case(
        lengths=(3, 40, 77), heads=10, kv_heads=2, head_dim=24, page_size=32, row_pages=3
    ),
    "dim-72-group-8-pages-of-5": Case(
        lengths=(1, 12, 23), heads=8, kv_heads=1, head_dim=72, page_size=5, row_pages=5,
        window=9,
    ),
}  # fmt: skip


@pytest.mark.parametrize("kernel", CPU_WALKS)
@pytest.mark.parametrize("name", list(CPP_EDGE_CASES))
def test_the_cpp_kernels_paths_equal_naive_at_odd_shapes(name, kernel):
    case = CPP_EDGE_CASES[name]
    paged, q_positions, contiguous = build(case, seed=11)
    got = run(KERNELS[kernel], case, paged, q_positions)
    assert_close(got, reference(case, paged[0], q_positions, contiguous), case, contiguous[1])


def test_a_cpu_without_avx2_refuses_its_walk():
    """The AVX2 walk asked for by name: the naive result on a CPU with AVX2 and FMA, else an
    error that names what the CPU lacks."""
    case = Case(lengths=(3, 20))
    paged, q_positions, contiguous = build(case, seed=12)
    kernel = CpuDecodeKernel(walk="avx2")
    if cpu_has_avx2_fma():
        got = run(kernel, case, paged, q_positions)
        assert_close(got, reference(case, paged[0], q_positions, contiguous), case, contiguous[1])
    else:
        with pytest.raises(Exception, match="needs a CPU with AVX2 and FMA"):
            run(kernel, case, paged, q_positions).block_until_ready()


def test_the_cpp_kernels_derivative_is_the_xla_paths():
    """Forward mode through the C++ kernel (tests/infer/test_kv_int8.py's sensitivity of the
    logits to the cache): the tangent is the XLA path's, exactly."""
    case = Case(lengths=(3, 29, 50), window=20)
    (q, k_pages, v_pages, table, lengths), q_positions, contiguous = build(case, seed=10)

    def attend(kernel):
        return lambda q, k, v: paged_attention(
            q, k, v, table, lengths, q_positions=q_positions, sliding_window=case.window,
            kernel=kernel,
        )  # fmt: skip

    tangents = [jax.random.normal(jax.random.key(i), x.shape) for i, x in enumerate((q, k_pages))]
    primals = (q, k_pages, v_pages)
    cpu, d_cpu = jax.jit(lambda *t: jax.jvp(attend(CpuDecodeKernel()), primals, t))(
        *tangents, jnp.zeros_like(v_pages)
    )
    xla, d_xla = jax.jit(lambda *t: jax.jvp(attend(XlaPagedKernel()), primals, t))(
        *tangents, jnp.zeros_like(v_pages)
    )
    np.testing.assert_array_equal(d_cpu, d_xla)
    assert_close(cpu, xla, case, contiguous[1])


def test_the_default_block_on_a_cpu_holds_a_fixed_number_of_key_floats():
    """GPT-2's keys (12 heads x 64) walk in blocks of 64, SmolLM2's (3 x 64) in 256: the largest
    power of two whose keys fit `CPU_BLOCK_FLOATS` floats a row, within [16, 256]."""
    assert jax.default_backend() == "cpu"
    for width, keys in [(768, 64), (192, 256), (512, 128), (64, 256), (2**14, 16)]:
        assert keys_per_block_for(width) == keys
        assert keys == 16 or keys == 256 or keys * width <= CPU_BLOCK_FLOATS < 2 * keys * width


@pytest.mark.parametrize("kernel", list(KERNELS))
def test_row_holding_nothing_outputs_zero(kernel):
    case = Case(lengths=(0, 20))
    paged, q_positions, contiguous = build(case, seed=3)
    got = np.asarray(run(KERNELS[kernel], case, paged, q_positions))
    np.testing.assert_array_equal(got[0], 0.0)
    want = reference(case, paged[0], q_positions, contiguous)
    assert_close(got[1], want[1], case, contiguous[1])


@pytest.mark.parametrize("kernel", ["xla", "pallas-splits", "cpu"])
def test_lengths_past_the_table_under_jit_see_the_table_only(kernel):
    """Under jit nothing can check a length against the table: keys past the table's slots do
    not exist (no read through the padding or past the row's last page)."""
    case = Case(lengths=(20, 64))
    paged, q_positions, contiguous = build(case, seed=6)
    too_long = (*paged[:4], jnp.array([20, 64 + 9], jnp.int32))
    got = run(KERNELS[kernel], case, too_long, q_positions + jnp.array([[0], [9]]))
    want = reference(case, paged[0], q_positions + jnp.array([[0], [9]]), contiguous)
    assert_close(got, want, case, contiguous[1])


@pytest.mark.parametrize("kernel", ["pallas-splits", "cpu"])
def test_random_lengths_compile_once(kernel):
    """Lengths and page tables are runtime values: new ones reuse the compiled step."""
    kernel = KERNELS[kernel]
    step = jax.jit(
        lambda *a: paged_attention(*a[:5], q_positions=a[5], sliding_window=9, kernel=kernel)
    )
    rng = np.random.default_rng(4)
    for seed in range(3):
        case = Case(lengths=tuple(int(n) for n in rng.integers(1, 65, 3)), window=9)
        paged, q_positions, contiguous = build(case, seed=seed)
        k_pages = jnp.pad(paged[1], ((0, 0), (0, 16 - paged[1].shape[1]), (0, 0), (0, 0)))
        v_pages = jnp.pad(paged[2], ((0, 0), (0, 16 - paged[2].shape[1]), (0, 0), (0, 0)))
        got = step(paged[0], k_pages, v_pages, *paged[3:], q_positions)
        assert_close(got, reference(case, paged[0], q_positions, contiguous), case, contiguous[1])
    assert step._cache_size() == 1


def test_write_pages_round_trip():
    """A prefill chunk with padding, then a decode step, written into an empty pool, read back
    through the table: every valid token where the table says, nothing else touched."""
    kv, p, d = 2, 4, 8
    rng = np.random.default_rng(5)
    table = np.array([[5, 2, 7], [1, 0, 0]], np.int32)  # row 1 owns page 1 only
    pool = jnp.full((kv, 9, p, d), -1.0)
    k = rng.standard_normal((2, 7, kv, d), np.float32)
    groups = np.repeat([0, 1], 6)
    positions = np.tile(np.arange(6), 2).astype(np.int32)
    valid = np.array([1, 1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0], bool)  # row 1: 3 tokens + padding
    write = jax.jit(write_pages, donate_argnums=0)
    pool = write(pool, table, groups, positions, k[:, :6].reshape(12, kv, d), jnp.asarray(valid))
    # Decode: row 0 writes position 6 (page 7, offset 2); row 1 is idle (not valid).
    pool = write(
        pool, table, np.array([0, 1]), np.array([6, 3], np.int32), k[:, 6], jnp.array([1, 0], bool)
    )
    want = np.full((kv, 9, p, d), -1.0, np.float32)
    for row, n in [(0, 7), (1, 3)]:
        for pos in range(n):
            want[:, table[row, pos // p], pos % p] = k[row, pos]
    np.testing.assert_array_equal(pool, want)


def test_write_pages_drops_positions_without_a_page():
    """A position past the row's table (or negative) writes nothing: no wrap-around into another
    row's page."""
    table = jnp.array([[1, 2]], jnp.int32)
    pool = jnp.zeros((1, 4, 2, 16))
    new = jnp.ones((2, 1, 16))
    out = write_pages(
        pool, table, jnp.array([0, 0]), jnp.array([4, -1], jnp.int32), new, jnp.ones(2, bool)
    )
    np.testing.assert_array_equal(out, 0.0)


def test_write_pages_updates_the_donated_pool_in_place():
    """The compiled step aliases the pool to its output and changes it by a scatter: no
    instruction makes a pool-sized copy."""
    kv, n_pages, p, d = 2, 64, 16, 32
    pool = jax.ShapeDtypeStruct((kv, n_pages, p, d), jnp.float32)
    new = jax.ShapeDtypeStruct((12, kv, d), jnp.float32)
    index = jax.ShapeDtypeStruct((12,), jnp.int32)
    table = jax.ShapeDtypeStruct((4, 8), jnp.int32)
    valid = jax.ShapeDtypeStruct((12,), jnp.bool_)
    compiled = (
        jax.jit(write_pages, donate_argnums=0)
        .lower(pool, table, index, index, new, valid)
        .compile()
    )
    hlo = compiled.as_text()
    assert "input_output_alias={ {}: (0, {}, may-alias) }" in hlo
    pool_type = f"f32[{kv},{n_pages},{p},{d}]"
    ops = [line.split("=", 1)[1].split() for line in hlo.splitlines() if f"= {pool_type}" in line]
    # The entry parameter, one fusion wrapping the scatter, and inside it the scatter and its
    # operand: no copy, and no other pool-sized instruction.
    kinds = collections.Counter(words[1].split("(")[0] for words in ops)
    assert kinds == {"parameter": 2, "fusion": 1, "scatter": 1}, kinds


def inputs(b=2, t=1, h=4, kv=2, d=16, p=16, n_pages=8, row_pages=4, dtype=jnp.float32):
    return (
        jnp.zeros((b, t, h, d), dtype),
        jnp.zeros((kv, n_pages, p, d), dtype),
        jnp.zeros((kv, n_pages, p, d), dtype),
        jnp.zeros((b, row_pages), jnp.int32),
        jnp.ones((b,), jnp.int32),
    ), jnp.zeros((b, t), jnp.int32)


@pytest.mark.parametrize(
    ("changes", "kwargs", "message"),
    [
        ({"h": 3}, {}, "heads=3 must be a multiple of kv_heads=2"),
        ({}, {"sliding_window": 0}, "sliding_window must be >= 1, got 0"),
        ({"t": 4}, {"kernel": PallasDecodeKernel()}, r"seq == 1\), got seq=4; use XlaPagedKernel"),
        ({"d": 24}, {"kernel": PallasDecodeKernel()}, "head_dim in"),
        ({"p": 12}, {"kernel": PallasDecodeKernel()}, "power-of-two page_size, got 12"),
        ({"dtype": jnp.float8_e4m3fn}, {"kernel": PallasDecodeKernel()}, "one dtype of"),
    ],
)
def test_bad_inputs_are_refused(changes, kwargs, message):
    args, q_positions = inputs(**changes)
    kwargs = {"kernel": XlaPagedKernel(), **kwargs}
    with pytest.raises(ValueError, match=message):
        paged_attention(*args, q_positions=q_positions, **kwargs)


def test_mismatched_shapes_are_refused(without_runtime_typechecks):
    (q, k_pages, v_pages, table, lengths), q_positions = inputs()
    with pytest.raises(ValueError, match="differs from the pools' head_dim 16"):
        paged_attention(
            q[..., :8], k_pages, v_pages, table, lengths, q_positions=q_positions,
            kernel=XlaPagedKernel(),
        )  # fmt: skip
    with pytest.raises(ValueError, match="must have the same shape and dtype"):
        paged_attention(
            q,
            k_pages,
            v_pages[:1],
            table,
            lengths,
            q_positions=q_positions,
            kernel=XlaPagedKernel(),
        )
    with pytest.raises(ValueError, match=r"lengths must be integers of shape \[2\]"):
        paged_attention(
            q,
            k_pages,
            v_pages,
            table,
            lengths[:1],
            q_positions=q_positions,
            kernel=XlaPagedKernel(),
        )


def test_page_table_values_are_checked():
    (q, k_pages, v_pages, table, _), q_positions = inputs()
    with pytest.raises(ValueError, match=r"row 1 holds 65 tokens but its page table has 4 pages"):
        paged_attention(
            q, k_pages, v_pages, table, jnp.array([3, 65], jnp.int32), q_positions=q_positions,
            kernel=XlaPagedKernel(),
        )  # fmt: skip
    with pytest.raises(ValueError, match="row 0's page table points at page 8, outside the pool"):
        check_page_table(np.array([[0, 8], [1, 2]]), np.array([17, 3]), page_size=16, n_pages=8)
    # Entries past a row's last page are never read: any value is fine there.
    check_page_table(np.array([[0, 99], [1, -1]]), np.array([16, 3]), page_size=16, n_pages=8)


def test_pallas_settings_are_checked(without_runtime_typechecks):
    with pytest.raises(ValueError, match="keys_per_block=24 must be a power of two >= 16"):
        PallasDecodeKernel(keys_per_block=24)
    with pytest.raises(ValueError, match="splits must be >= 1 or None, got 0"):
        PallasDecodeKernel(splits=0)
    args, q_positions = inputs()
    with pytest.raises(TypeError, match="kernel must be XlaPagedKernel"):
        paged_attention(*args, q_positions=q_positions, kernel="pallas")


@pytest.mark.parametrize(
    ("heads", "kv_heads", "head_dim", "page_size"),
    [(8, 2, 64, 16), (32, 8, 128, 32), (12, 4, 64, 64), (16, 2, 128, 16)],
)
def test_pallas_decode_lowers_for_cuda_through_triton(heads, kv_heads, head_dim, page_size):
    """The real (non-interpret) kernel at bf16 GPU-like sizes and the default settings passes
    Triton's lowering checks without a GPU (groups of 3 query heads included)."""
    b, n_pages, row_pages = 8, 256, 32
    shapes = (
        jax.ShapeDtypeStruct((b, 1, heads, head_dim), jnp.bfloat16),
        jax.ShapeDtypeStruct((kv_heads, n_pages, page_size, head_dim), jnp.bfloat16),
        jax.ShapeDtypeStruct((kv_heads, n_pages, page_size, head_dim), jnp.bfloat16),
        jax.ShapeDtypeStruct((b, row_pages), jnp.int32),
        jax.ShapeDtypeStruct((b,), jnp.int32),
        jax.ShapeDtypeStruct((b, 1), jnp.int32),
    )

    def step(q, k_pages, v_pages, table, lengths, q_positions):
        return paged_attention(
            q, k_pages, v_pages, table, lengths, q_positions=q_positions, sliding_window=4096,
            kernel=PallasDecodeKernel(interpret=False),
        )  # fmt: skip

    with jax.sharding.use_abstract_mesh(cuda_mesh()):
        lowered = jax.jit(step).trace(*shapes).lower(lowering_platforms=("cuda",))
    assert lowered.as_text().count("__gpu$xla.gpu.triton") == 1
