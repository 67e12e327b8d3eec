"""Every flash shape and setting the GPU benchmarks will run lowers for CUDA on this CPU (the real
kernels, not the interpreter): a bad block shape costs a test failure here, not a GPU minute.

Lowering only (`jit(...).trace(...).lower(lowering_platforms=("cuda",))` on abstract inputs):
nothing is allocated or run, so the GPU sizes cost no memory.
"""

import jax
import jax.numpy as jnp
import pytest

from bench import attention, flash_blocks, flash_errors
from layers.kernels import BlockSizes, causal_mask, flash_attention
from layers.kernels.flash.config import DEFAULT_BLOCK_SIZES
from tests.layers.test_flash import cuda_mesh

TRITON_CALL = "__gpu$xla.gpu.triton"


def lower_for_cuda(batch, seq, heads, kv_heads, head_dim, dtype, blocks, window=None) -> str:
    """StableHLO of flash forward+backward for CUDA; with `window`, packed documents (segment
    ids) and a sliding window, else plain causal."""
    q = jax.ShapeDtypeStruct((batch, seq, heads, head_dim), jnp.dtype(dtype))
    kv = jax.ShapeDtypeStruct((batch, seq, kv_heads, head_dim), jnp.dtype(dtype))
    rows = jax.ShapeDtypeStruct((batch, seq), jnp.int32)

    def fwd_bwd(q, k, v, positions, segments):
        mask = causal_mask(positions, None if window is None else segments, sliding_window=window)
        out, vjp = jax.vjp(
            lambda *a: flash_attention(*a, mask, block_sizes=blocks, interpret=False), q, k, v
        )
        return out, vjp(out)

    with jax.sharding.use_abstract_mesh(cuda_mesh()):
        traced = jax.jit(fwd_bwd).trace(q, kv, kv, rows, rows)
        return traced.lower(lowering_platforms=("cuda",)).as_text()


def kernels_per_call(blocks: BlockSizes) -> int:
    """Triton calls of one forward+backward: the forward and the backward kernel(s)."""
    return 1 + blocks.backward_kernels


@pytest.mark.parametrize("shape", attention.shapes(gpu=True), ids=lambda s: s.label())
def test_attention_bench_shapes_lower_for_cuda(shape):
    text = lower_for_cuda(
        shape.batch,
        shape.seq,
        shape.heads,
        shape.kv_heads,
        shape.head_dim,
        shape.dtype,
        DEFAULT_BLOCK_SIZES,
    )
    assert text.count(TRITON_CALL) == kernels_per_call(DEFAULT_BLOCK_SIZES)


BATCH, SEQ, HEADS, KV_HEADS, DTYPE, HEAD_DIMS = flash_blocks.problem(gpu=True)


@pytest.mark.parametrize("head_dim", HEAD_DIMS)
@pytest.mark.parametrize("blocks", flash_blocks.settings(gpu=True), ids=repr)
def test_flash_block_sweep_settings_lower_for_cuda(blocks, head_dim):
    text = lower_for_cuda(BATCH, SEQ, HEADS, KV_HEADS, head_dim, DTYPE, blocks)
    assert text.count(TRITON_CALL) == kernels_per_call(blocks)


@pytest.mark.parametrize("case", flash_errors.error_cases(gpu=True), ids=lambda c: c.name)
def test_flash_error_cases_lower_for_cuda(case):
    text = lower_for_cuda(
        case.batch,
        case.seq,
        case.heads,
        case.kv_heads,
        case.head_dim,
        case.dtype,
        DEFAULT_BLOCK_SIZES,
        window=case.packed_window,
    )
    assert text.count(TRITON_CALL) == kernels_per_call(DEFAULT_BLOCK_SIZES)
