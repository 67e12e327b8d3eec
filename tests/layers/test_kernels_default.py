"""The kernels chosen by default per backend, and cuDNN's refusals off a GPU."""

import jax
import jax.numpy as jnp
import pytest

from layers.kernels import CpuDecodeKernel, Cudnn, PallasDecodeKernel, XlaPagedKernel, causal_mask
from layers.kernels.paged import Int8Pages
from layers.kernels.paged.attention import default_decode_kernel
from layers.paged_cache import POOL_AXES


def pools(head_dim: int, page_size: int = 16, dtype=jnp.float32):
    return jnp.zeros((2, 4, page_size, head_dim), dtype)


@pytest.mark.parametrize(
    "backend, seq, head_dim, page_size, layer, want",
    [
        ("cpu", 1, 64, 16, None, CpuDecodeKernel),
        ("cpu", 1, 64, 16, 0, CpuDecodeKernel),  # stacked layers: the C++ kernel takes the index
        ("cpu", 4, 64, 16, None, CpuDecodeKernel),  # a prefill chunk: each token its own item
        ("gpu", 1, 64, 16, None, PallasDecodeKernel),
        ("gpu", 4, 64, 16, None, XlaPagedKernel),  # a prefill chunk: Pallas decodes only
        ("gpu", 1, 80, 16, None, XlaPagedKernel),  # a head_dim Triton does not tile
        ("gpu", 1, 64, 12, None, XlaPagedKernel),  # a page size that is not a power of two
        ("gpu", 1, 64, 16, 0, XlaPagedKernel),  # stacked layers: Pallas reads one layer's pool
    ],
)
def test_the_default_decode_kernel_is_pallas_on_a_gpu_and_cpp_on_a_cpu_where_they_serve(
    monkeypatch, backend, seq, head_dim, page_size, layer, want
):
    monkeypatch.setattr(jax, "default_backend", lambda: backend)
    q = jnp.zeros((1, seq, 4, head_dim))
    layer = None if layer is None else jnp.int32(layer)
    assert isinstance(default_decode_kernel(q, pools(head_dim, page_size), layer), want)


def test_int8_pools_are_read_by_the_pallas_kernel_on_a_gpu(monkeypatch):
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    q = jnp.zeros((1, 1, 4, 64), jnp.bfloat16)
    pool = Int8Pages.zeros((2, 4, 16, 64), POOL_AXES)
    assert isinstance(default_decode_kernel(q, pool, None), PallasDecodeKernel)


def test_cudnn_attention_is_refused_off_a_gpu_with_what_to_use():
    q = jnp.zeros((1, 8, 2, 64), jnp.bfloat16)
    mask = causal_mask(jnp.arange(8)[None])
    with pytest.raises(ValueError, match=r"attention='cudnn' runs only on NVIDIA GPUs.*'flash'"):
        Cudnn()(q, q, q, mask)


def test_cudnn_attention_refuses_what_cudnn_cannot_compute(monkeypatch):
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    mask = causal_mask(jnp.arange(8)[None])
    bf16 = jnp.zeros((1, 8, 2, 64), jnp.bfloat16)
    with pytest.raises(ValueError, match="cannot soft-cap"):
        Cudnn()(bf16, bf16, bf16, mask, softcap=30.0)
    with pytest.raises(ValueError, match="bfloat16 or float16, not float32"):
        Cudnn()(*(jnp.zeros((1, 8, 2, 64)),) * 3, mask)
