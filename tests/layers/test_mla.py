"""Multi-head latent attention: the absorbed form over a paged latent cache (the XLA path and
the Pallas decode kernel) equals the expanded form; flash equals naive; a kernel or cache that
cannot run it says so."""

import equinox as eqx
import jax
import jax.numpy as jnp
import pytest

from layers.kernels import Flash, Naive, causal_mask
from layers.kernels.paged import PallasDecodeKernel, XlaPagedKernel
from layers.mla import MLA
from layers.paged_cache import LatentPages, LayerPages, PagedKVCache
from layers.quantized import QuantizedLinear
from layers.rotary import rotary_frequencies
from tests.layers.test_paged import CPU_WALKS, KERNELS

D_MODEL, SEQ, ROPE = 32, 16, 8
# kv_rank + rope = 32 and max(head_dim, v_dim) = 16: widths the flash and Pallas kernels take.
MLA_SIZES = {"n_heads": 2, "head_dim": 16, "rope_dim": ROPE, "v_dim": 16, "kv_rank": 24}
# Float32 sums of <= 32 products associated differently: ~1e-6 relative, 1e-5 leaves margin.
TOLERANCE = 1e-5


def mla(q_rank=8, **changes) -> MLA:
    sizes = MLA_SIZES | changes
    return MLA(D_MODEL, **sizes, q_rank=q_rank, scale=0.3, key=jax.random.key(0))


def inputs(seq=SEQ):
    x = jax.random.normal(jax.random.key(1), (1, seq, D_MODEL))
    positions = jnp.arange(seq)[None]
    return x, positions, causal_mask(positions, None)


def rope(positions):
    return rotary_frequencies(positions, head_dim=ROPE, theta=10_000.0)


@eqx.filter_jit
def run(layer, x, mask, rope, kernel, cache=None):
    """One jitted call (interpreted Pallas kernels run far faster compiled than op by op)."""
    return layer(x, mask, rope, kernel=kernel, cache=cache)


def relative_error(ours, reference) -> float:
    return float(jnp.max(jnp.abs(ours - reference)) / jnp.max(jnp.abs(reference)))


def latent_cache(kernel=None, pools=None) -> PagedKVCache:
    """One row of SEQ tokens in two pages of 8 (in reverse pool order) of one MLA layer."""
    kernel = kernel or XlaPagedKernel()
    pools = pools or (LatentPages.zeros(4, 8, 32, jnp.float32),)
    return PagedKVCache(pools, jnp.array([[2, 1]]), jnp.zeros((1,), jnp.int32), kernel=kernel,
                        page_size=8)  # fmt: skip


@pytest.mark.parametrize("q_rank", [8, None])
def test_latent_cache_and_flash_equal_the_expanded_naive_form(q_rank):
    layer, (x, positions, mask) = mla(q_rank), inputs()
    expected, _ = run(layer, x, mask, rope(positions), Naive())
    flash = Flash(interpret=True)
    assert relative_error(run(layer, x, mask, rope(positions), flash)[0], expected) < TOLERANCE
    cache = latent_cache()
    step = cache.append(jnp.ones((1, SEQ), bool))
    view = step.view(cache.layers[0], None)
    out, view = run(layer, x, step.mask, rope(step.positions), flash, view)
    assert relative_error(out, expected) < TOLERANCE
    # The cache holds the latent per token: kv_rank + rope_dim numbers, nothing per head.
    assert view.arrays.c.shape == (1, 4, 8, 24 + ROPE)


@pytest.mark.parametrize(
    "decode_kernel",
    [
        XlaPagedKernel(), PallasDecodeKernel(keys_per_block=16, interpret=True),
        *(KERNELS[name] for name in CPU_WALKS),
    ],
)  # fmt: skip
def test_paged_latent_pools_equal_the_expanded_form(decode_kernel):
    """Prefill 12 tokens into a row's pages (the XLA path), then decode one (the decode
    kernel): the expanded form's output at each position."""
    layer, (x, positions, mask) = mla(), inputs(13)
    expected, _ = run(layer, x, mask, rope(positions), Naive())
    cache = latent_cache(decode_kernel)
    outs = []
    for chunk in (x[:, :12], x[:, 12:]):
        step = cache.append(jnp.ones(chunk.shape[:2], bool))
        view = step.view(cache.layers[0], None)
        out, view = run(layer, chunk, step.mask, rope(step.positions), Naive(), view)
        cache = step.cache.with_layers((view.arrays,))
        outs.append(out)
    assert relative_error(jnp.concatenate(outs, axis=1), expected) < TOLERANCE


def test_flash_refuses_an_mla_width_it_cannot_tile():
    layer, (x, positions, mask) = mla(head_dim=24), inputs()
    with pytest.raises(ValueError, match="head_dim=24 is not supported"):
        layer(x, mask, rope(positions), kernel=Flash(interpret=True))


def test_a_per_head_cache_is_refused():
    layer, (x, _, _) = mla(), inputs()
    cache = latent_cache(pools=(LayerPages.zeros(4, 8, 2, 16, jnp.float32),))
    step = cache.append(jnp.ones((1, SEQ), bool))
    with pytest.raises(ValueError, match=r"per-head K/V pools.*init_cache"):
        layer(
            x,
            step.mask,
            rope(step.positions),
            kernel=Naive(),
            cache=step.view(cache.layers[0], None),
        )


def test_decode_with_a_quantized_up_projection_says_what_to_do():
    # kv_rank 32: packed rows hold multiples of 32 inputs (the refusal comes before the cache).
    layer, (x, _, _) = mla(kv_rank=32), inputs()
    quantized = QuantizedLinear.from_linear(layer.kv_b_proj, "int8")
    layer = eqx.tree_at(lambda m: m.kv_b_proj, layer, quantized)
    cache = latent_cache()
    step = cache.append(jnp.ones((1, SEQ), bool))
    view = step.view(cache.layers[0], None)
    with pytest.raises(ValueError, match=r"QuantizedLinear.*dequantize_base"):
        layer(x, step.mask, rope(step.positions), kernel=Naive(), cache=view)
