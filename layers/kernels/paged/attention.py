"""`paged_attention`: attention from groups of query tokens to each group's pages of the pool,
with three implementations chosen explicitly by the caller or by `default_decode_kernel` (never
one falling back on another):

- `XlaPagedKernel()`: XLA, any backend, any number of query tokens per group (decode and prefill
  chunks), walking only the blocks of pages that hold visible keys (blocked.py);
- `PallasDecodeKernel(...)`: the Pallas decode kernel (GPU; interpreted on CPU), seq == 1 only;
- `CpuDecodeKernel()`: the C++ decode kernel (layers/kernels/cpu/paged.cc), CPU, float32,
  seq == 1 only.
"""

import dataclasses
import math

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from layers.kernels.cpu.paged import cpu_paged_decode
from layers.kernels.flash.config import SUPPORTED_DTYPES, SUPPORTED_HEAD_DIMS
from layers.kernels.paged.blocked import blocked_attention
from layers.kernels.paged.decode import DecodePlan, default_splits, paged_decode
from layers.kernels.paged.int8 import Int8Pages
from layers.kernels.paged.pages import Pool, check_page_table, is_concrete
from shard.rules import active


def _is_power_of_two(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


@dataclasses.dataclass(frozen=True, kw_only=True)
class XlaPagedKernel:
    """The XLA path (blocked.py): an online softmax over blocks of `keys_per_block` keys (whole
    pages, at least one), only the blocks that hold visible keys. Larger blocks mean fewer loop
    iterations and more masked keys at the edges. None (the default) picks
    `keys_per_block_for` the pool's key width and the backend; bench/RESULTS.md has the
    measurement."""

    keys_per_block: int | None = None

    def __post_init__(self):
        if self.keys_per_block is not None and (
            not isinstance(self.keys_per_block, int) or self.keys_per_block < 1
        ):
            raise ValueError(
                "XlaPagedKernel.keys_per_block must be a positive int or None, got "
                f"{self.keys_per_block!r}"
            )


# On a CPU, a block of about this many key floats per row (kv_heads x head_dim per key): the
# block's gather is the walk's cost there, and the keys past a short row's length are read in
# full. Decode at 8 rows on this CPU (bench/RESULTS.md, "Paged attention's block size") was
# fastest at 64 keys for GPT-2 (768 floats a key) and 256 for SmolLM2 (192).
CPU_BLOCK_FLOATS = 2**16
# Elsewhere (the XLA path serves prefill chunks on a GPU) the fixed block measured there.
KEYS_PER_BLOCK = 256


def keys_per_block_for(key_width: int) -> int:
    """The default block of `XlaPagedKernel` for keys of `key_width` floats (kv_heads x
    head_dim, MLA: the latent width): on a CPU the power of two nearest below
    `CPU_BLOCK_FLOATS / key_width`, within [16, KEYS_PER_BLOCK]; `KEYS_PER_BLOCK` elsewhere."""
    if jax.default_backend() != "cpu":
        return KEYS_PER_BLOCK
    keys = CPU_BLOCK_FLOATS // max(key_width, 1)
    return min(KEYS_PER_BLOCK, max(16, 1 << max(keys.bit_length() - 1, 0)))


@dataclasses.dataclass(frozen=True, kw_only=True)
class PallasDecodeKernel:
    """The Pallas paged decode kernel and its launch settings.

    `keys_per_block`: keys per step of a program's loop (a power of two >= 16), i.e.
    `max(1, keys_per_block // page_size)` pages gathered per step. `splits`: programs per
    (row, K/V head), each taking a share of the row's blocks; None picks
    `decode.default_splits` (about 128 programs in all, at most 16 splits). Triton's
    `num_warps` / `num_stages`. `interpret=None` interprets on CPU and compiles otherwise.
    The defaults are reasoned, not yet measured on a GPU.
    """

    keys_per_block: int = 64
    splits: int | None = None
    num_warps: int = 4
    num_stages: int = 2
    interpret: bool | None = None

    def __post_init__(self):
        if not (_is_power_of_two(self.keys_per_block) and self.keys_per_block >= 16):
            raise ValueError(
                f"PallasDecodeKernel.keys_per_block={self.keys_per_block} must be a power of two "
                ">= 16 (Triton tiles are powers of two and its matmul needs sides >= 16)"
            )
        if self.splits is not None and self.splits < 1:
            raise ValueError(f"PallasDecodeKernel.splits must be >= 1 or None, got {self.splits}")


@dataclasses.dataclass(frozen=True, kw_only=True)
class CpuDecodeKernel:
    """The C++ paged attention kernel of a CPU (layers/kernels/cpu/paged.cc): decode steps and
    prompt chunks, float32 q and pools, each (query token, K/V head) one item of XLA's thread
    pool reading its row's pages in place, a page at a time (a token's output the same bits
    whatever else the step holds). `walk`: "fastest" (the CPU's: AVX-512 16 keys at a time,
    else AVX2 8, else plain C++ one key at a time), or "avx2" or "portable" on any CPU, so a
    test can run each (`layers.kernels.cpu.WALKS`)."""

    walk: str = "fastest"


PagedKernel = XlaPagedKernel | PallasDecodeKernel | CpuDecodeKernel


def _check_shapes(q, k_pages, v_pages, page_table, lengths, q_positions, sliding_window, layer):
    pool_dims = 4 if layer is None else 5
    if q.ndim != 4 or k_pages.ndim != pool_dims:
        pools = "[kv_heads, pages, page_size, head_dim]"
        if layer is not None:
            pools = "[layers, kv_heads, pages, page_size, head_dim] (a layer index is given)"
        raise ValueError(
            f"paged attention: q must be [batch, seq, heads, head_dim] and the pools {pools}, got "
            f"q {q.shape} and k_pages {k_pages.shape}"
        )
    if v_pages is not None and (k_pages.shape != v_pages.shape or k_pages.dtype != v_pages.dtype):
        raise ValueError(
            f"paged attention: k_pages {k_pages.shape} {k_pages.dtype} and v_pages "
            f"{v_pages.shape} {v_pages.dtype} must have the same shape and dtype"
        )
    b, t, n_heads, d = q.shape
    n_kv = k_pages.shape[-4]
    if k_pages.shape[-1] != d:
        raise ValueError(
            f"paged attention: q head_dim {d} differs from the pools' head_dim {k_pages.shape[-1]}"
        )
    if n_heads % n_kv != 0:
        raise ValueError(
            f"paged attention: heads={n_heads} must be a multiple of kv_heads={n_kv} (the pools' "
            "K/V head axis)"
        )
    for name, x, shape in [
        ("page_table", page_table, (b, page_table.shape[-1])),
        ("lengths", lengths, (b,)),
        ("q_positions", q_positions, (b, t)),
    ]:
        if x.shape != shape or not jnp.issubdtype(x.dtype, jnp.integer):
            want = "[batch, row_pages]" if name == "page_table" else str(list(shape))
            raise ValueError(
                f"paged attention: {name} must be integers of shape {want} for q {q.shape}, got "
                f"{x.dtype} {x.shape}"
            )
    if isinstance(sliding_window, int) and sliding_window < 1:
        raise ValueError(f"paged attention: sliding_window must be >= 1, got {sliding_window}")


def _pallas_refusal(q, k_pages) -> str | None:
    """Why the Pallas decode kernel cannot serve this call, or None if it can."""
    t, d = q.shape[1], q.shape[3]
    if t != 1:
        return (
            f"the Pallas decode kernel takes one query token per row (seq == 1), got seq={t}; use "
            "XlaPagedKernel() (the XLA path) for prefill chunks"
        )
    if d not in SUPPORTED_HEAD_DIMS:
        return (
            f"the Pallas decode kernel needs head_dim in {SUPPORTED_HEAD_DIMS} (Triton tiles are "
            f"powers of two >= 16), got {d}; use XlaPagedKernel()"
        )
    if not _is_power_of_two(k_pages.shape[2]):
        return (
            f"the Pallas decode kernel needs a power-of-two page_size, got {k_pages.shape[2]}; "
            "use XlaPagedKernel()"
        )
    int8 = isinstance(k_pages, Int8Pages)
    if (q.dtype != k_pages.dtype and not int8) or jnp.dtype(q.dtype) not in SUPPORTED_DTYPES:
        return (
            f"the Pallas decode kernel needs q in one dtype of "
            f"{[x.name for x in SUPPORTED_DTYPES]} and the pools in the same dtype or int8, got "
            f"q {q.dtype} and pools {k_pages.dtype}"
        )
    return None


def _cpu_refusal(q, k_pages) -> str | None:
    """Why the C++ decode kernel cannot serve this call, or None if it can."""
    if jax.default_backend() != "cpu":
        return f"the C++ decode kernel runs on a CPU, not {jax.default_backend()}"
    if isinstance(k_pages, Int8Pages) or q.dtype != jnp.float32 or k_pages.dtype != jnp.float32:
        return (
            f"the C++ decode kernel needs float32 q and pools, got q {q.dtype} and pools "
            f"{k_pages.dtype}; use XlaPagedKernel()"
        )
    if active() is not None:
        return "the C++ decode kernel has no sharding rule; use XlaPagedKernel() under a mesh"
    return None


def _cpu_decode(
    q, k_pages, v_pages, page_table, lengths, q_positions, window, softcap, layer, walk
):
    """The C++ kernel's call, its derivatives (forward mode) the XLA path's, as for the dense
    kernel's products: the tangent of the same attention computed by XLA's ops."""
    n_kv, d = k_pages.shape[-4], k_pages.shape[-1]

    def xla(q, k_pages, v_pages):
        return blocked_attention(
            q, k_pages, v_pages, page_table, lengths, q_positions, window, softcap,
            keys_per_block=keys_per_block_for(n_kv * d), layer=layer,
        )  # fmt: skip

    @jax.custom_jvp
    def call(q, k_pages, v_pages):
        return cpu_paged_decode(
            q, k_pages, v_pages, page_table, lengths, q_positions, window, softcap, layer,
            walk=walk,
        )  # fmt: skip

    call.defjvp(lambda primals, tangents: (call(*primals), jax.jvp(xla, primals, tangents)[1]))
    return call(q, k_pages, v_pages)


def _compiled_on_gpu(interpret: bool) -> bool:
    return jax.default_backend() == "gpu" and not interpret


def default_decode_kernel(q, k_pages, layer) -> PagedKernel:
    """The kernel of a call whose cache names none: on a GPU the Pallas decode kernel wherever
    it serves the call (one token per row, one layer's pool, a head_dim, page_size and dtype it
    tiles, in q's dtype or int8; faster than the XLA path on an H100, bench/RESULTS.md), on a
    CPU the C++ kernel wherever it serves the call (float32, no sharding rules; decode steps
    and prompt chunks, each token's output independent of the rest of the step: the engine's
    tokens do not depend on what else a step holds), the XLA path everywhere else. An
    explicitly chosen kernel is never replaced."""
    serves = layer is None and _pallas_refusal(q, k_pages) is None
    if _compiled_on_gpu(False) and serves:
        return PallasDecodeKernel()
    if _cpu_refusal(q, k_pages) is None:
        return CpuDecodeKernel()
    return XlaPagedKernel()


def paged_attention(
    q: Float[Array, "batch seq heads head_dim"],
    k_pages: Pool,
    v_pages: Pool | None,
    page_table: Int[Array, "batch row_pages"],
    lengths: Int[Array, " batch"],
    *,
    q_positions: Int[Array, "batch seq"],
    sliding_window: Int[Array, ""] | int | None = None,
    softcap: float | None = None,
    kernel: PagedKernel | None = None,
    layer: Int[Array, ""] | None = None,
) -> Float[Array, "batch seq heads head_dim"]:
    """softmax(softcap(q k^T / sqrt(d)) + mask) v over each row's keys in the page pool (layout
    in `pages.py`), with K/V heads shared by groups of query heads (GQA/MQA). `sliding_window`
    may be traced (one layer's window under `lax.scan`); `softcap` caps the scaled scores at
    softcap * tanh(s / softcap) (Gemma 2). `v_pages=None`: the values are the keys (MLA's
    latent pool). The pools may be int8 with per-(token, head) scales (`int8.Int8Pages`, both
    pools alike): attention over their dequantized values, read as int8. `layer`: the pools
    carry a leading stacked-layers axis and this layer's pages are read (XLA path only; never a
    copy of the layer's whole pool). `kernel=None`: the backend's default
    (`default_decode_kernel`).

    The key at position j is visible to the query at position `q_positions[b, i]` iff
    j <= that position, j < lengths[b] and (no window or position - j < sliding_window): a decode
    step (seq == 1) and a causal prefill chunk over pages already written (seq == C) are the same
    call. A query that sees no key (an idle row with length 0, or a negative position: padding)
    outputs 0.

    Shapes, dtypes and the window are checked before tracing (ValueError). Page table values are
    checked with `check_page_table` when the arguments are concrete; under jit the caller
    guarantees them (keys past a row's table are then ignored, out-of-pool page ids are
    undefined behaviour).
    """
    _check_shapes(q, k_pages, v_pages, page_table, lengths, q_positions, sliding_window, layer)
    n_kv, n_pages, page_size, d = k_pages.shape[-4:]
    if is_concrete(page_table, lengths):
        check_page_table(page_table, lengths, page_size=page_size, n_pages=n_pages)
    if kernel is None:
        kernel = default_decode_kernel(q, k_pages, layer)
    if isinstance(kernel, XlaPagedKernel):
        keys_per_block = kernel.keys_per_block or keys_per_block_for(n_kv * d)
        return blocked_attention(
            q, k_pages, v_pages, page_table, lengths, q_positions, sliding_window, softcap,
            keys_per_block=keys_per_block, layer=layer,
        )  # fmt: skip
    if isinstance(kernel, CpuDecodeKernel):
        refusal = _cpu_refusal(q, k_pages)
        if refusal is not None:
            raise ValueError(f"paged attention: {refusal}")
        return _cpu_decode(
            q, k_pages, v_pages, page_table, lengths, q_positions, sliding_window, softcap, layer,
            kernel.walk,
        )  # fmt: skip
    if not isinstance(kernel, PallasDecodeKernel):
        raise TypeError(
            "paged attention: kernel must be XlaPagedKernel(), PallasDecodeKernel(...) or "
            f"CpuDecodeKernel(), got {kernel!r}"
        )
    if layer is not None:
        raise ValueError(
            "paged attention: the Pallas decode kernel reads one layer's pool; use unrolled layer "
            "storage (Policy(storage='unrolled')) or XlaPagedKernel()"
        )
    refusal = _pallas_refusal(q, k_pages)
    if refusal is not None:
        raise ValueError(f"paged attention: {refusal}")
    interpret = jax.default_backend() == "cpu" if kernel.interpret is None else kernel.interpret
    ppb = max(1, kernel.keys_per_block // page_size)
    blocks = -(-page_table.shape[1] // ppb)
    plan = DecodePlan(
        windowed=sliding_window is not None,
        softcap=softcap,
        scale=1.0 / math.sqrt(d),
        pages_per_block=ppb,
        splits=kernel.splits or default_splits(q.shape[0], n_kv, blocks),
        num_warps=kernel.num_warps,
        num_stages=kernel.num_stages,
        interpret=interpret,
    )
    window = (
        None
        if sliding_window is None
        else jnp.broadcast_to(jnp.asarray(sliding_window, jnp.int32), lengths.shape)
    )
    v_pages = k_pages if v_pages is None else v_pages
    return paged_decode(q, k_pages, v_pages, page_table, lengths, q_positions, window, plan)
