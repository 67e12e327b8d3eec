"""Gemma's attention features in every kernel: score soft-capping and a sliding window that is
data (a traced per-layer value under `lax.scan`), against the naive specification. Flash in
values and gradients, still skipping the tiles outside a traced window; the paged kernels
(gather and Pallas decode) in values; xla refuses soft-capping."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from layers.kernels import AttentionMask, causal_mask, flash_attention, naive_attention
from layers.kernels.flash.tiles import tile_visibility
from layers.kernels.paged import (
    PallasDecodeKernel,
    XlaPagedKernel,
    paged_attention,
)
from layers.kernels.xla import xla_attention
from tests.layers.test_flash import SMALL, assert_close
from tests.layers.test_paged import CPU_WALKS, KERNELS, Case, build, reference
from tests.layers.test_paged import assert_close as assert_close_paged

CAP = 2.0  # small enough that tanh bends most random scores (|q.k| / sqrt(16) ~ 1..4)


def test_flash_softcap_and_traced_windows_match_naive():
    """Two "layers" under one `lax.scan`, windows 5 and 1000 carried as data: values and
    gradients of both layers' outputs equal naive's (GQA 4:2, 64 tokens, 16-wide tiles)."""
    kq, kk, kv = jax.random.split(jax.random.key(0), 3)
    q = jax.random.normal(kq, (2, 64, 4, 16)) * 2
    k = jax.random.normal(kk, (2, 64, 2, 16)) * 2
    v = jax.random.normal(kv, (2, 64, 2, 16))
    mask = causal_mask(jnp.broadcast_to(jnp.arange(64), (2, 64)))
    windows = jnp.array([5, 1000], jnp.int32)

    def layers(kernel, q, k, v):
        def layer(carry, window):
            return carry, kernel(q, k, v, mask.with_window(window), softcap=CAP)

        return jax.lax.scan(layer, 0, windows)[1]

    def value_and_grads(kernel, *qkv):
        out, vjp = jax.vjp(lambda *a: layers(kernel, *a), *qkv)
        return out, vjp(jnp.cos(out))

    flash = lambda *a, softcap: flash_attention(*a, softcap=softcap, block_sizes=SMALL)  # noqa: E731
    out, grads = jax.jit(lambda *a: value_and_grads(flash, *a))(q, k, v)
    want, want_grads = jax.jit(lambda *a: value_and_grads(naive_attention, *a))(q, k, v)
    # Window 5 and no window really differ, and so do capped and uncapped scores.
    assert float(jnp.abs(want[0] - want[1]).max()) > 0.1
    uncapped = naive_attention(q, k, v, mask.with_window(5))
    assert float(jnp.abs(want[0] - uncapped).max()) > 0.1
    assert_close(out, want, "float32", 4)
    for got, expected in zip(grads, want_grads, strict=True):
        assert_close(got, expected, "float32", 16)


def test_traced_window_still_skips_tiles():
    """The tile bounds come from plain XLA on the positions: a traced window gives the same
    visibility as a static one, so tiles outside it are skipped (most of them here)."""
    pos = jnp.broadcast_to(jnp.arange(128), (1, 128))

    def tiles(window):
        return tile_visibility(
            pos, pos, None, None, causal=True, window=window, block_q=16, block_k=16
        )

    traced = jax.jit(tiles)(jnp.int32(20))
    static = tiles(20)
    for a, b in zip(traced, static, strict=True):
        np.testing.assert_array_equal(a, b)
    dense = np.asarray(causal_mask(pos, sliding_window=20).dense())
    np.testing.assert_array_equal(traced[0], dense.reshape(1, 8, 16, 8, 16).any(axis=(2, 4)))
    assert int(traced[0].sum()) < 8 * 9 // 2  # fewer tiles than causal attention alone visits


@pytest.mark.parametrize(
    "kernel",
    [
        XlaPagedKernel(),
        PallasDecodeKernel(keys_per_block=16, splits=2),
        *(KERNELS[name] for name in CPU_WALKS),
    ],
    ids=["xla", "pallas", *CPU_WALKS],
)
def test_paged_softcap_and_traced_window_match_naive(kernel):
    case = Case(lengths=(5, 37, 60), window=9)
    (q, k_pages, v_pages, table, lengths), q_positions, contiguous = build(case)
    q = q * 3

    @jax.jit
    def run(window):
        return paged_attention(
            q, k_pages, v_pages, table, lengths, q_positions=q_positions,
            sliding_window=window, softcap=CAP, kernel=kernel,
        )  # fmt: skip

    k, v = contiguous
    b, capacity = k.shape[:2]
    kv_positions = jnp.broadcast_to(jnp.arange(capacity), (b, capacity))
    mask = AttentionMask(
        q_positions=q_positions,
        kv_positions=kv_positions,
        q_segment_ids=jnp.ones(q_positions.shape, jnp.int32),
        kv_segment_ids=(kv_positions < lengths[:, None]).astype(jnp.int32),
        sliding_window=case.window,
    )
    want = naive_attention(q, jnp.asarray(k), jnp.asarray(v), mask, softcap=CAP)
    assert float(jnp.abs(want - reference(case, q, q_positions, contiguous)).max()) > 0.1
    assert_close_paged(run(jnp.int32(case.window)), want, case, v)


def test_xla_refuses_soft_capping():
    q = jnp.zeros((1, 4, 2, 16))
    mask = causal_mask(jnp.arange(4)[None])
    with pytest.raises(ValueError, match=r"attention='xla' cannot soft-cap.*use attention='flash'"):
        xla_attention(q, q, q, mask, softcap=CAP)
